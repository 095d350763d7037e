"""DFlash2 drafts (issue 82): TensorRT-LLM serves them under `decoding_type: DFlash`, keyed off the draft checkpoint.

The rules and sentences are upstream's (TensorRT-LLM tensorrt_llm/_torch/models/modeling_dflash.py @ad8349f6,
speculative/dflash.py and tests/unittest/_torch/speculative/hw_agnostic/test_dflash2_semantics.py @10e95278). The
drafts here are real files: config.json shaped after z-lab/Qwen3.8-27B-DFlash2's, shrunk onto the SmolLM2 target, with
safetensors whose extra tensors are spelled out from upstream's shape formulas (not from our own code).
"""

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import SMOL_MASK_ID
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trtllm_dflash.cli import main
from trtllm_dflash.config import DraftConfig, is_dflash2_architecture
from trtllm_dflash.deploy import BuildOptions, trtllm_backend
from trtllm_dflash.deploy.memory import plan_memory
from trtllm_dflash.deploy.options import resolve_sources
from trtllm_dflash.deploy.recipes import Parallelism, model_facts_from_hf_config
from trtllm_dflash.deploy.trtllm.options import llm_options
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import check_draft, load_draft, read_draft_config
from trtllm_dflash.models.draft import DFlashDraftModel

# z-lab/Qwen3.8-27B-DFlash2's config.json as third-party fixtures mirror it (the public file itself was not found).
RELEASED = {
    "architectures": ["DFlash2DraftModel"],
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": 248070,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [5, 19, 33, 47, 61],
    },
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 262144,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "vocab_size": 248320,
}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LAYERS = 2


def small_config(target_dir) -> dict:
    """The released recipe shrunk onto the SmolLM2 target: its width, heads and RoPE; 2 layers, rank 8, top-k 4."""
    t = json.loads((target_dir / "config.json").read_text())
    raw = copy.deepcopy(RELEASED)
    raw["dflash_config"] |= {"mask_token_id": SMOL_MASK_ID, "selector_rank": 8, "selector_top_k": 4}
    raw["dflash_config"]["target_layer_ids"] = [1, t["num_hidden_layers"] // 2]
    raw |= {
        "hidden_size": t["hidden_size"],
        "head_dim": t["head_dim"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "intermediate_size": 96,
        "vocab_size": t["vocab_size"],
        "num_hidden_layers": LAYERS,
        "layer_types": ["sliding_attention"] * LAYERS,
        "num_target_layers": t["num_hidden_layers"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_parameters": dict(t["rope_parameters"]),
        "max_position_embeddings": t["max_position_embeddings"],
    }
    return raw


def upstream_extra_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """DFlash2's tensors beyond DFlash 1's, from modeling_dflash.py @ad8349f6's shape checks, written out here."""
    d, h = raw["dflash_config"], raw["hidden_size"]
    k, g, r = d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    out = {}
    for i in range(raw["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)  # [2, conv_kernel_size, hidden_size]
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * h // g, h)
    out["candidate_selector.predecessor_codebook"] = (raw["vocab_size"], r)  # [vocab_size, selector_rank]
    out["candidate_selector.successor_codebook"] = (raw["vocab_size"], r)
    out["candidate_selector.hidden_projection.weight"] = (r, h)
    return out


def write_draft(path, raw: dict, extra_shapes: dict[str, tuple[int, ...]]) -> dict:
    """config.json + bf16 model.safetensors: DFlash 1's tensors from the draft module, `extra_shapes` random."""
    path.mkdir(parents=True)
    base = {**raw, "architectures": ["DFlashDraftModel"]}
    base["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if k not in DFLASH2_KEYS}
    model = DFlashDraftModel(DraftConfig.from_dict(base))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    tensors |= {k: (0.02 * torch.randn(s, generator=g)).to(torch.bfloat16) for k, s in extra_shapes.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return raw


@pytest.fixture(scope="module")
def dflash2_dir(target_dir, tmp_path_factory):
    raw = small_config(target_dir)
    path = tmp_path_factory.mktemp("dflash2") / "draft"
    write_draft(path, raw, upstream_extra_shapes(raw))
    return path


@pytest.fixture(scope="module")
def dflash1_dir(target_dir, tmp_path_factory):
    """The same draft as DFlash 1: no convolutions or selector, DFlashDraftModel, the four keys absent."""
    raw = small_config(target_dir)
    raw["architectures"] = ["DFlashDraftModel"]
    raw["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if k not in DFLASH2_KEYS}
    path = tmp_path_factory.mktemp("dflash1") / "draft"
    write_draft(path, raw, {})
    return path


def extra_bytes(path, names) -> int:
    """The bytes of `names` in a checkpoint, read from its safetensors header."""
    with safe_open(path / "model.safetensors", framework="pt") as st:
        return sum(torch.Size(st.get_slice(n).get_shape()).numel() * 2 for n in names)


# ------------------------------------------------------------------------------------------- recognising the draft


def test_the_released_recipe_is_dflash2_and_counts_its_real_size():
    c = DraftConfig.from_dict(RELEASED)
    assert c.is_dflash2 and (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert c.block_size == 8 and c.mask_token_id == 248070 and c.target_layer_ids == [5, 19, 33, 47, 61]
    assert c.dflash2_shapes == upstream_extra_shapes(RELEASED)
    assert c.dflash2_shapes["layers.0.attention_conv.kernel_projection.weight"] == (1280, 5120)
    assert c.dflash2_shapes["candidate_selector.successor_codebook"] == (248320, 256)
    # A deployment guide pinning z-lab's revision ac04198 reports model.safetensors at 3,848,817,896 bytes holding
    # 81 tensors: bf16 parameters (ours, plus the QK-norm weights param_count leaves out) and the header.
    assert len(c.dflash2_shapes) + 3 + 11 * c.num_hidden_layers == 81
    header = 3_848_817_896 - 2 * (c.param_count + c.num_hidden_layers * 2 * c.head_dim)
    assert 0 < header < 16 * 1024
    # the top-level is_causal counts for a DFlash2 draft: every (sliding) layer is non-causal in a 2048 window
    assert [(c.layer_is_causal(i), c.layer_window(i)) for i in range(5)] == [(False, 2048)] * 5
    assert c.trtllm_noncausal_window() == (0, 2048)


def test_the_round_trip_keeps_the_recipe_and_the_label():
    c = DraftConfig.from_dict(RELEASED)
    written = c.to_dict()
    assert written["architectures"] == ["DFlash2DraftModel"] and written["is_causal"] is False
    assert written["dflash_config"] == RELEASED["dflash_config"] and "block_size" not in written
    again = DraftConfig.from_dict(written)
    assert (again.is_dflash2, again.dflash2_shapes, again.param_count) == (True, c.dflash2_shapes, c.param_count)
    for key in DFLASH2_KEYS:
        assert key not in again.extra["dflash_config"]


@pytest.mark.parametrize(
    "architectures, expected",
    [
        (["DFlash2DraftModel"], True),
        (["DFlash2Qwen3ForCausalLM"], True),
        (["dflash_2_draft_model"], True),
        (["DFlashDraftModel"], False),
        (["Qwen3ForCausalLM"], False),
        (None, False),
    ],
)
def test_architecture_labels_as_upstream_reads_them(architectures, expected):
    """test_dflash2_semantics.py's cases for _is_dflash2_architecture."""
    assert is_dflash2_architecture(architectures) is expected


def test_either_size_alone_or_the_label_alone_makes_a_dflash2_draft():
    """Upstream's switch: the label, conv_kernel_size > 0 or selector_rank > 0; a partial recipe is then refused."""
    base = {**RELEASED, "architectures": ["DFlashDraftModel"]}
    base["dflash_config"] = {k: v for k, v in RELEASED["dflash_config"].items() if k not in DFLASH2_KEYS}
    assert not DraftConfig.from_dict(base).is_dflash2
    for change in ({"conv_kernel_size": 2}, {"selector_rank": 8}, {"architectures": ["DFlash2DraftModel"]}):
        raw = copy.deepcopy(base)
        if "architectures" in change:
            raw |= change
        else:
            raw["dflash_config"] |= change
        with pytest.raises(DFlashError, match="DFlash 2 drafter is missing required dflash_config entries"):
            DraftConfig.from_dict(raw)


# ------------------------------------------------------------------------------------------------ real checkpoints


def test_a_small_dflash2_checkpoint_validates(dflash2_dir):
    c = check_draft(dflash2_dir)
    assert c.is_dflash2 and read_draft_config(dflash2_dir) == c
    names = set(load_file(dflash2_dir / "model.safetensors"))
    assert len(names) == 6 + 15 * LAYERS  # as released: 6 shared + 15 per layer
    assert set(c.dflash2_shapes) <= names


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"conv_group_size": None},
            "DFlash 2 drafter is missing required dflash_config entries ['conv_group_size']; got "
            "{'conv_kernel_size': 2, 'conv_group_size': 0, 'selector_rank': 8, 'selector_top_k': 4}.",
        ),
        (
            {"selector_top_k": None, "conv_kernel_size": 0},
            "DFlash 2 drafter is missing required dflash_config entries ['conv_kernel_size', 'selector_top_k']; got "
            "{'conv_kernel_size': 0, 'conv_group_size': 16, 'selector_rank': 8, 'selector_top_k': 0}.",
        ),
        (
            {"selector_top_k": 1},
            "DFlash 2 selector_top_k=1 leaves no candidates to choose between; it must be at least 2.",
        ),
        ({"conv_group_size": 7}, "DFlash2 conv_group_size=7 must divide hidden_size=576."),
        ({"conv_kernel_size": "2"}, "The draft's dflash_config.conv_kernel_size must be an integer, got '2'."),
        (
            {"draft_vocab_size": 32000},
            "DFlash 2 candidate selection requires a shared draft/target vocab (d2t vocab mapping is not supported).",
        ),
    ],
)
def test_each_missing_or_bad_key_gets_upstreams_sentence(dflash2_dir, tmp_path, change, message):
    raw = json.loads((dflash2_dir / "config.json").read_text())
    for key, value in change.items():
        if key == "draft_vocab_size":
            raw[key] = value
        elif value is None:
            del raw["dflash_config"][key]
        else:
            raw["dflash_config"][key] = value
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(raw))
    shutil.copyfile(dflash2_dir / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(DFlashError) as e:
        read_draft_config(bad)
    assert str(e.value) == message


def test_tensors_must_match_the_recipe(dflash2_dir, tmp_path):
    tensors = load_file(dflash2_dir / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "candidate_selector.successor_codebook"}, "missing"),
        "shape": (
            {**tensors, "layers.1.mlp_conv.base_kernel": torch.zeros(2, 3, 576, dtype=torch.bfloat16)},
            r"layers\.1\.mlp_conv\.base_kernel has shape \(2, 3, 576\) but its config implies \(2, 2, 576\)",
        ),
        "d2t": (
            {**tensors, "d2t": torch.zeros(49152, dtype=torch.int64)},
            r"requires a shared draft/target vocab \(d2t vocab mapping is not supported\)\.",
        ),
    }
    for name, (state, message) in cases.items():
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text((dflash2_dir / "config.json").read_text())
        save_file(state, path / "model.safetensors")
        with pytest.raises(DFlashError, match=message):
            check_draft(path)


# ---------------------------------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize("tp", [1, 2])
def test_the_memory_plan_counts_the_convolutions_and_the_selector(target_dir, dflash1_dir, dflash2_dir, tp):
    """The draft weights row of a DFlash2 draft exceeds its DFlash 1 twin's by exactly the extra tensors' bf16 bytes
    as the checkpoint holds them (replicated on every GPU, as `fc`)."""
    config = json.loads((target_dir / "config.json").read_text())
    facts = model_facts_from_hf_config({**config, "torch_dtype": "bfloat16"})  # served in bf16, as the build does
    d1, d2 = check_draft(dflash1_dir), check_draft(dflash2_dir)
    names = set(load_file(dflash2_dir / "model.safetensors")) - set(load_file(dflash1_dir / "model.safetensors"))
    assert names == set(upstream_extra_shapes(small_config(target_dir)))
    extra = extra_bytes(dflash2_dir, names)

    def row(d):
        plan = plan_memory(
            facts, d, Parallelism(tp=tp), "none", "auto", 2, 256, "h100", tp, max_num_tokens=256, max_draft_len=7
        )
        return plan.row("draft weights (bf16)")

    assert row(d2) - row(d1) == pytest.approx(extra, abs=1)
    assert 2 * (d2.param_count - d1.param_count) == extra


# ------------------------------------------------------------------------------------------- TensorRT-LLM builds


def QUIET(message: str) -> None:
    pass


def _options(target_dir, draft, **kw) -> BuildOptions:
    return BuildOptions(
        output=target_dir.parent / "unused",
        target=str(target_dir),
        draft=str(draft),
        backend="trtllm",
        dtype="bf16",
        **kw,
    )


def test_a_tensorrt_llm_dry_run_plans_a_validated_deployment(target_dir, dflash2_dir, dflash1_dir, tmp_path):
    out = tmp_path / "out"
    args = ["build", "--backend", "trtllm", "--target", str(target_dir), "--draft", str(dflash2_dir)]
    result = CliRunner().invoke(main, [*args, "--max-seq-len", "256", "--dry-run", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "draft weights (bf16)" in result.output and "fits" in result.output and not out.exists()

    dep, _ = trtllm_backend.plan_deployment(_options(target_dir, dflash2_dir, max_seq_len=256), QUIET, resolve_sources)
    assert dep.recipe.draft_config.is_dflash2 and dep.memory.fits
    spec = dep.options()["speculative_config"]  # checked against the release's fields and validators
    assert spec["decoding_type"] == "DFlash" and spec["speculative_model"] == "../../../checkpoints/draft"
    assert spec["max_draft_len"] == 7 and "attention_backend" not in spec  # VANILLA, upstream's default
    assert dep.serve_options()["speculative_config"]["speculative_model"] == "checkpoints/draft"
    twin, _ = trtllm_backend.plan_deployment(_options(target_dir, dflash1_dir, max_seq_len=256), QUIET, resolve_sources)
    names = set(dep.recipe.draft_config.dflash2_shapes)
    growth = dep.memory.row("draft weights (bf16)") - twin.memory.row("draft weights (bf16)")
    assert growth == pytest.approx(extra_bytes(dflash2_dir, names), abs=1)


@pytest.mark.parametrize("gpu", ["b200", "h100"])
def test_the_trtllm_drafter_attention_is_refused_for_non_causal_sliding_layers(target_dir, dflash2_dir, gpu):
    """PR #19159: trtllm-gen's context kernel refuses causal=False with any finite window, so TensorRT-LLM refuses
    the TRTLLM drafter backend for the released (all-sliding, is_causal false) drafts; no GPU changes that."""
    dep, _ = trtllm_backend.plan_deployment(_options(target_dir, dflash2_dir, gpu=gpu), QUIET, resolve_sources)
    trtllm = {"speculative_config": {"attention_backend": "TRTLLM"}}
    with pytest.raises(DFlashError) as e:
        llm_options(dep.recipe, model="m", draft="d", extra=trtllm)
    message = str(e.value)
    assert "draft layer 0" in message and "non-causally within a 2048-token sliding window" in message
    assert message.count(". ") == 0 and message.endswith(
        "use speculative_config.attention_backend VANILLA, the default."
    )
    for backend in ("VANILLA", "FA4") if gpu == "b200" else ("VANILLA",):  # "VANILLA and FA4 hand both window
        # bounds to their kernels" (FA4 only on Blackwell)
        llm_options(dep.recipe, model="m", draft="d", extra={"speculative_config": {"attention_backend": backend}})


def test_the_trtllm_drafter_attention_takes_causal_or_unwindowed_layers(target_dir, dflash2_dir):
    """test_trtllm_backend_accepts_causal_or_unwindowed_layers; and a DFlash 1 draft's is_causal is not read upstream,
    so its sliding layers stay causal there."""
    dep, _ = trtllm_backend.plan_deployment(_options(target_dir, dflash2_dir, gpu="b200"), QUIET, resolve_sources)
    d = dep.recipe.draft_config
    trtllm = {"speculative_config": {"attention_backend": "TRTLLM"}}
    dflash1 = dataclasses.replace(d, architectures=None, **dict.fromkeys(DFLASH2_KEYS))
    for draft in (
        dataclasses.replace(d, is_causal=True),
        dataclasses.replace(d, layer_types=["full_attention"] * LAYERS),
        dataclasses.replace(d, sliding_window=None),
        dflash1,
    ):
        assert draft.trtllm_noncausal_window() is None
        llm_options(dataclasses.replace(dep.recipe, draft_config=draft), model="m", draft="d", extra=trtllm)


# ------------------------------------------------------------------------------------------ the embedded runtime


def test_the_embedded_runtime_refuses_a_dflash2_draft_in_one_sentence(target_dir, dflash2_dir, tmp_path):
    sentence = "is a DFlash2 draft, and the embedded runtime does not run DFlash2 drafts yet; build it for TensorRT-LLM"
    for load in (
        lambda: DFlashEngine.load(str(target_dir), str(dflash2_dir), progress=lambda m: None),
        lambda: load_draft(dflash2_dir),
    ):
        with pytest.raises(DFlashError, match=sentence) as e:
            load()
        assert str(e.value).endswith("with --backend trtllm.") and str(e.value).count(". ") == 0
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["build", "--target", str(target_dir), "--draft", str(dflash2_dir), "--dry-run", "--output", str(out)]
    )
    assert result.exit_code == 2 and sentence in result.output and "Traceback" not in result.output
    assert not out.exists()
    with pytest.raises(DFlashError, match="--draft-engine exports the PyTorch draft model, which does not run DFlash2"):
        resolve_sources(_options(target_dir, dflash2_dir, draft_engine=True), QUIET)  # the ONNX drafter is the same


def test_convert_takes_a_dflash2_label_for_a_draft(dflash2_dir, tmp_path):
    """`trtdflash convert` tells a draft from a target by its architectures; a DFlash2 label is a draft's."""
    from trtllm_dflash.convert import ConvertOptions

    assert ConvertOptions(model=str(dflash2_dir), quant="fp8", output=tmp_path / "out").role == "draft"
