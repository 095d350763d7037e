"""`trtdflash build` for TensorRT-LLM, without a GPU or weights: the one-line command, every preset, bad input."""

import json
import subprocess

import pytest
import torch
import yaml
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.config import DraftConfig
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.deploy.recipes import load_recipe, presets
from trtllm_dflash.deploy.trtllm.schema import validate_llm_args
from trtllm_dflash.models.checkpoint import save_draft
from trtllm_dflash.models.draft import DFlashDraftModel


def _build(tmp_path, *args):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", *args, "--output", str(out)])
    return result, out


def test_the_one_line_gpt_oss_120b_command_writes_a_validated_deployment(tmp_path):
    result, out = _build(tmp_path, "--target", "gpt-oss-120b", "--tp", "8")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["serve"] == {"model_repository": "triton_repo", "model": "ensemble", "backend": "trtllm"}
    assert manifest["sources"]["target"] == {"hf_id": "openai/gpt-oss-120b"}
    assert manifest["resolved"]["num_gpus"] == 8 and manifest["resolved"]["fits"]
    assert sorted(p.name for p in (out / "triton_repo").iterdir()) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
    ]
    assert not (out / "checkpoints").exists()  # nothing downloaded: the GPU host fetches the public ids

    model_yaml = yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    validate_llm_args(model_yaml, "model.yaml")
    assert model_yaml["model"] == "openai/gpt-oss-120b" and model_yaml["tensor_parallel_size"] == 8
    assert model_yaml["speculative_config"]["decoding_type"] == "DFlash"
    assert model_yaml["speculative_config"]["speculative_model"] == "z-lab/gpt-oss-120b-DFlash"
    serve_yaml = yaml.safe_load((out / "trtllm-serve.yaml").read_text())
    assert serve_yaml.pop("num_postprocess_workers") == 4 and "num_postprocess_workers" not in model_yaml
    assert serve_yaml == {k: v for k, v in model_yaml.items() if k != "model"}

    ensemble = (out / "triton_repo/ensemble/config.pbtxt").read_text()
    assert 'model_name: "tensorrt_llm"' in ensemble and "${" not in ensemble
    launch = out / "launch.sh"
    assert launch.stat().st_mode & 0o111 and subprocess.run(["bash", "-n", str(launch)]).returncode == 0
    assert (
        "need=8" in launch.read_text()
        and "trtllm-serve openai/gpt-oss-120b --config trtllm-serve.yaml" in launch.read_text()
    )
    deploy = (out / "DEPLOY.md").read_text()
    assert "8 x B200" in deploy and "DFlash context arena" in deploy and "target KV cache" in deploy
    assert "TensorRT-LLM 1.4.0rc1" in deploy and "TensorRT-LLM TensorRT-LLM" not in deploy
    assert "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc1" in deploy and "install --no-deps trtllm-dflash" not in deploy
    carried = out / "python/trtllm_dflash"
    assert (carried / "serving/engine_model.py").is_file() and (
        carried / "deploy/trtllm/releases/1.4.0rc1.json"
    ).is_file()
    assert not (carried / "drafts").exists()


def test_trtllm_version_selects_the_release(tmp_path):
    result, out = _build(tmp_path, "--target", "qwen3-8b", "--gpu", "h100", "--trtllm-version", "main@0004396")
    assert result.exit_code == 0, result.output
    assert "TensorRT-LLM main@0004396" in (out / "DEPLOY.md").read_text()
    result, out = _build(tmp_path / "b", "--target", "qwen3-8b", "--trtllm-version", "1.2.1")
    assert result.exit_code == 2 and "--trtllm-version must be one of" in result.output and not out.exists()


def test_dry_run_prints_the_memory_plan_and_writes_nothing(tmp_path):
    result, out = _build(tmp_path, "--target", "gpt-oss-120b", "--gpu", "h100", "--dry-run")
    assert result.exit_code == 0, result.output
    for expected in (
        "recipe gpt-oss-120b/h100",
        "Memory per GPU (8 x h100",
        "target experts",
        "target KV cache",
        "fits",
    ):
        assert expected in result.output
    assert not out.exists()


@pytest.mark.parametrize("recipe_id", [r for ids in presets().values() for r in ids])
def test_every_recipe_validates_and_plans(recipe_id, tmp_path):
    model, _, stem = recipe_id.partition("/")
    gpu, _, profile = stem.partition("-")
    msgs = []
    run_build(
        BuildOptions(output=tmp_path / "out", target=model, gpu=gpu, recipe=profile or None),
        progress=msgs.append,
        dry_run=True,
    )
    assert any(f"recipe {recipe_id}" in m for m in msgs) and any("fits" in m for m in msgs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "gpt-oss-121b"], "nor a GPU preset (gpt-oss-120b, gpt-oss-20b"),
        (["--target", "gpt-oss-120b", "--tp", "3"], "tp 3"),
        (["--target", "gpt-oss-120b", "--ep", "3"], "ep 3"),
        (
            ["--target", "qwen3-8b", "--gpu", "h100", "--quant", "nvfp4"],
            "NVFP4 needs Blackwell; use --quant fp8 on H100",
        ),
        (
            ["--target", "gpt-oss-120b", "--gpu", "h200", "--quant", "nvfp4"],
            "NVFP4 needs Blackwell; use --quant mxfp4 on H200",
        ),
        (
            ["--target", "qwen3-4b", "--quant", "fp8"],
            "TensorRT-LLM does not quantize at load time; build from its weights with --target DIR",
        ),
        (["--target", "gpt-oss-120b", "--gpu", "b200", "--recipe", "fastest"], "no 'fastest' profile"),
        (["--target", "gpt-oss-120b", "--gpu", "a100"], "no recipe for GPU 'a100'"),
        (["--target", "qwen3-8b", "--gpu", "h100", "--max-batch-size", "100000"], "does not fit"),
        (["--target", "qwen3-8b", "--draft", "smollm2-135m"], "hidden size"),
        (["--target", "smollm2-135m", "--ep", "2"], "ep 2 needs a mixture-of-experts target"),
        (["--target", "smollm2-135m", "--backend", "torch", "--tp", "2"], "--tp needs --backend trtllm"),
    ],
)
def test_bad_input_is_one_sentence_exit_2_nothing_written(tmp_path, args, message):
    result, out = _build(tmp_path, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_local_draft_for_a_preset_target_is_staged_into_the_deployment(tmp_path):
    """A draft trained here for a preset (checked against the preset's facts) ships inside the build."""
    facts = load_recipe("qwen3-4b").model_facts
    cfg = DraftConfig(
        hidden_size=facts.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=facts.num_heads,
        num_key_value_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        intermediate_size=64,
        vocab_size=facts.vocab_size,
        block_size=4,
        mask_token_id=5,
        target_layer_ids=[1],
        num_target_layers=facts.num_layers,
    )
    model = DFlashDraftModel(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_draft(model, tmp_path / "draft", dtype=torch.bfloat16)
    result, out = _build(tmp_path, "--target", "qwen3-4b", "--draft", str(tmp_path / "draft"))
    assert result.exit_code == 0, result.output
    assert (out / "checkpoints/draft/model.safetensors").is_file()
    spec = yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())["speculative_config"]
    assert spec["speculative_model"] == "../../../checkpoints/draft" and spec["max_draft_len"] == 3


def test_force_writes_a_plan_that_does_not_fit(tmp_path):
    result, out = _build(tmp_path, "--target", "qwen3-8b", "--gpu", "h100", "--max-batch-size", "100000", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["resolved"]["fits"] is False


def test_a_quantized_recipe_loads_its_quantized_checkpoint(tmp_path):
    result, out = _build(tmp_path, "--target", "qwen3-8b", "--gpu", "b200")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())["model"] == "nvidia/Qwen3-8B-FP4"


def test_backend_is_chosen_by_the_target_and_gpu_options():
    assert BuildOptions(output="x").resolved_backend == "torch"
    assert BuildOptions(output="x", target="gpt-oss-120b").resolved_backend == "trtllm"
    assert BuildOptions(output="x", target="smollm2-135m", gpu="h100").resolved_backend == "trtllm"
    assert BuildOptions(output="x", target="smollm2-135m", quant="fp8").resolved_backend == "trtllm"
    assert BuildOptions(output="x", target="gpt-oss-120b", backend="torch").resolved_backend == "torch"


def test_local_weights_are_quantized_into_the_deployment(target_dir, tmp_path):
    """--quant on local weights runs ModelOpt (trtdflash convert) in the build; every file agrees on the format."""
    out = tmp_path / "out"
    run_build(
        BuildOptions(
            output=out, target=str(target_dir), draft="smollm2-135m", gpu="b200", quant="nvfp4", max_seq_len=512
        ),
        progress=lambda m: None,
    )
    hf_quant = json.loads((out / "checkpoints/target/hf_quant_config.json").read_text())["quantization"]
    assert (
        hf_quant["quant_algo"] == "NVFP4" and hf_quant["group_size"] == 16 and hf_quant["kv_cache_quant_algo"] is None
    )
    config = json.loads((out / "checkpoints/target/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    model_yaml = yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    assert model_yaml["model"] == "../../../checkpoints/target" and model_yaml["kv_cache_config"]["dtype"] == "auto"
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        "quantize_target" in manifest["steps"]
        and "checkpoints/target/model.safetensors" in manifest["steps"]["quantize_target"]["outputs"]
    )
    assert "NVFP4" in (out / "DEPLOY.md").read_text() or "nvfp4" in (out / "DEPLOY.md").read_text()


def test_a_build_output_named_like_a_preset_does_not_shadow_it(tmp_path, monkeypatch):
    """The README builds into `gpt-oss-120b/`; a second build of the preset from that folder's parent still
    means the preset, while a folder holding a checkpoint's config.json is a local target."""
    monkeypatch.chdir(tmp_path)
    for recipe in ("throughput", "latency"):
        result = CliRunner().invoke(
            main, ["build", "--target", "gpt-oss-120b", "--recipe", recipe, "--output", "gpt-oss-120b"]
        )
        assert result.exit_code == 0, result.output
    assert "b200-latency" in (tmp_path / "gpt-oss-120b/launch.sh").read_text()
    assert BuildOptions(output="x", target="gpt-oss-120b").resolved_backend == "trtllm"
    (tmp_path / "gpt-oss-120b/config.json").write_text("{}")
    assert BuildOptions(output="x", target="gpt-oss-120b").resolved_backend == "torch"


def test_untested_dflash_combinations_take_the_tested_choice_unless_opted_in(tmp_path):
    """Upstream shows no DFlash test with attention-DP, an FP8 KV cache on gpt-oss, KV block reuse or gpt-oss's TRITON
    MoE on Hopper: the build takes the tested choice, says so in DEPLOY.md, and --opt-in takes the recipe's own."""
    result, out = _build(tmp_path / "a", "--target", "gpt-oss-120b", "--gpu", "b200", "--recipe", "throughput")
    assert result.exit_code == 0, result.output
    o = yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    assert o["enable_attention_dp"] is False and "attention_dp_config" not in o
    assert o["kv_cache_config"]["dtype"] == "auto" and o["kv_cache_config"]["enable_block_reuse"] is False
    assert "attention-DP off" in (out / "DEPLOY.md").read_text() and "--opt-in" in (out / "DEPLOY.md").read_text()
    args = [a for name in ("attention-dp", "fp8-kv", "block-reuse") for a in ("--opt-in", name)]
    result, out = _build(tmp_path / "b", "--target", "gpt-oss-120b", "--gpu", "b200", "--recipe", "throughput", *args)
    assert result.exit_code == 0, result.output
    o = yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())
    assert o["enable_attention_dp"] is True and o["kv_cache_config"]["dtype"] == "fp8"
    assert "enable_block_reuse" not in o["kv_cache_config"]
    for extra, backend in (((), "CUTLASS"), (("--opt-in", "triton-moe"), "TRITON")):
        result, out = _build(tmp_path / backend, "--target", "gpt-oss-120b", "--gpu", "h100", *extra)
        assert result.exit_code == 0, result.output
        assert (
            yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())["moe_config"]["backend"]
            == backend
        )
    result, out = _build(tmp_path / "c", "--target", "qwen3-8b", "--gpu", "h100")  # FP8 checkpoint: FP8 KV is tested
    assert (
        yaml.safe_load((out / "triton_repo/tensorrt_llm/1/model.yaml").read_text())["kv_cache_config"]["dtype"] == "fp8"
    )
    result, _ = _build(tmp_path / "d", "--target", "qwen3-8b", "--opt-in", "everything")
    assert result.exit_code == 2 and "Invalid value for '--opt-in'" in result.output


def test_the_shipped_draft_plans_with_its_measured_profile_unless_given_another(tmp_path):
    """The packaged SmolLM2 draft carries its speculation profile (measured on the built-in set): a TensorRT-LLM
    deployment of it plans its draft lengths and Dynamo's AIS acceptance from that profile's acceptance per position,
    and `--acceptance-profile` overrides it."""
    from trtllm_dflash.clients.specbench import PROFILE
    from trtllm_dflash.engine.plan import expected_tokens
    from trtllm_dflash.resolve import DRAFTS_DIR

    shipped = json.loads((DRAFTS_DIR / "smollm2-135m" / PROFILE).read_text())
    assert shipped["conditions"]["dataset"] == "builtin" and len(shipped["categories"]) >= 8
    result, out = _build(tmp_path, "--target", "smollm2-135m", "--gpu", "h100")
    assert result.exit_code == 0, result.output
    tau = expected_tokens(shipped["conditional"], len(shipped["conditional"]))
    assert f"acceptance profile {PROFILE} (builtin" in (out / "DEPLOY.md").read_text()
    assert f"measured, τ {tau:.2f}" in (out / "DEPLOY.md").read_text()
    rates = ",".join(f"{p:.4f}" for p in shipped["conditional"][:5])
    assert rates.split(",")[0] in (out / "dynamo" / "launch.sh").read_text()

    other = tmp_path / "mine.json"
    other.write_text(json.dumps({"conditional": [0.5] * 15, "conditions": {"dataset": "mine"}}))
    result, out = _build(
        tmp_path / "again", "--target", "smollm2-135m", "--gpu", "h100", "--acceptance-profile", str(other)
    )
    assert result.exit_code == 0, result.output
    assert "acceptance profile mine.json (mine)" in (out / "DEPLOY.md").read_text()
