"""`trtdflash build` without a server: plan, atomic output, links, manifest, skipping valid work, clear errors."""

import inspect
import json
import os
import shutil
from dataclasses import fields

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.config import ENGINE_FILE, EngineOptions
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.deploy import steps as build_module
from trtllm_dflash.engine.plan import conditional_for_tau
from trtllm_dflash.engine.policy import OPTIMISTIC
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import sha256_file


def _opts(out, draft, **kw):
    return BuildOptions(output=out, draft=str(draft), max_seq_len=512, **kw)


def test_dry_run_prints_the_plan_and_writes_nothing(random_draft_dir, tmp_path):
    out = tmp_path / "build"
    r = CliRunner().invoke(
        main, ["build", "--draft", str(random_draft_dir), "--output", str(out), "--dry-run", "--max-seq-len", "512"]
    )
    assert r.exit_code == 0, r.output
    for expected in (
        "Steps:",
        "target_checkpoint",
        "draft_checkpoint",
        "tokenizer",
        "triton_repo",
        "manifest",
        "checkpoints/target/model.safetensors",
        "Estimated memory per device",
    ):
        assert expected in r.output
    assert list(tmp_path.iterdir()) == []


def test_build_links_weights_writes_manifest_and_skips_valid_work(random_draft_dir, target_dir, tmp_path):
    out, msgs = tmp_path / "build", []
    run_build(_opts(out, random_draft_dir), progress=msgs.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # no temp siblings left
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["steps"]) == [
        "target_checkpoint",
        "tokenizer",
        "draft_checkpoint",
        "triton_repo",
        "engine_options",
    ]
    assert manifest["options"]["backend"] == "torch" and manifest["resolved"]["block_size"] == 16
    assert manifest["versions"]["trtllm-dflash"] and manifest["created"]
    weights = out / "checkpoints/target/model.safetensors"
    assert weights.stat().st_ino == (target_dir / "model.safetensors").stat().st_ino  # hard link, not a copy
    for step in manifest["steps"].values():
        for rel, meta in step["outputs"].items():
            if (out / rel).stat().st_size < 1 << 20:
                assert sha256_file(out / rel) == meta["sha256"], rel
    assert "${" not in (out / "triton_repo/dflash/config.pbtxt").read_text()
    engine = _engine_options(out)
    assert (out / "triton_repo/dflash" / engine.draft_dir / "config.json").is_file()
    assert (out / "triton_repo/dflash" / engine.target_dir / "config.json").is_file()

    msgs.clear()
    run_build(_opts(out, random_draft_dir), progress=msgs.append)
    assert "up to date" in msgs[-1]

    msgs.clear()
    run_build(_opts(out, random_draft_dir, max_batch_size=2), progress=msgs.append)
    assert sum("reusing the previous output" in m for m in msgs) == 4  # max_batch_size: the templates alone
    assert "max_batch_size: 2" in (out / "triton_repo/ensemble/config.pbtxt").read_text()
    assert weights.stat().st_ino == (target_dir / "model.safetensors").stat().st_ino

    # another draft of the same shape: only its step runs, and the reused repository keeps the (empty) version
    # folders Triton needs, or the ensemble fails to load
    other = tmp_path / "other-draft"
    shutil.copytree(random_draft_dir, other)
    (other / "training.json").write_text('{"final_metrics": {"val_tau": 3.0}}\n')
    msgs.clear()
    run_build(_opts(out, other, max_batch_size=2), progress=msgs.append)
    assert [m.split(":")[0] for m in msgs if "reusing" not in m and m.startswith("[")] == ["[3/5] draft_checkpoint"]
    assert (out / "checkpoints/draft/training.json").is_file()
    versions = [out / "triton_repo" / m / "1" for m in ("ensemble", "preprocessing", "dflash", "postprocessing")]
    assert all(v.is_dir() for v in versions)
    shutil.rmtree(versions[0])  # an output a build before this fix left without one is rebuilt, not reused
    msgs.clear()
    run_build(_opts(out, other, max_batch_size=2), progress=msgs.append)
    assert versions[0].is_dir() and any(m.startswith("[4/5] triton_repo: fill") for m in msgs)


def _engine_options(out) -> EngineOptions:
    path = out / "triton_repo/dflash" / ENGINE_FILE
    return EngineOptions.from_json(path.read_text(), str(path))


def test_engine_options_reach_the_served_model(random_draft_dir, tmp_path):
    """What `build` is told about the engine lands in the dflash model's parameters, and the model reads each one."""
    out = tmp_path / "build"
    r = CliRunner().invoke(
        main,
        [
            "build",
            "--draft",
            str(random_draft_dir),
            "--output",
            str(out),
            "--max-seq-len",
            "512",
            "--no-int8-draft",
            "--no-lookup",
            "--speculation",
            "fixed",
        ],
    )
    assert r.exit_code == 0, r.output
    opts = _engine_options(out)
    assert (opts.int8_draft, opts.lookup, opts.speculation) == (False, False, "fixed")
    # model.py loads the engine through DFlashEngine.from_options (as the Dynamo worker does): between them, each
    # option is read
    readers = (out / "triton_repo/dflash/1/model.py").read_text() + inspect.getsource(DFlashEngine.from_options)
    assert "DFlashEngine.from_options(opts" in readers
    assert [f.name for f in fields(EngineOptions) if f"opts.{f.name}" not in readers] == []
    run_build(_opts(out, random_draft_dir), progress=lambda m: None)  # the defaults
    opts = _engine_options(out)
    assert (opts.int8_draft, opts.lookup, opts.speculation) == (True, True, "adaptive")
    assert opts.draft_dir and opts.block_size > 1 and opts.dtype in ("fp32", "bf16")


def test_engine_options_that_are_not_what_build_writes_get_one_sentence():
    good = dict(
        target_dir="t",
        draft_dir="d",
        dtype="fp32",
        block_size=16,
        speculation="adaptive",
        lookup=True,
        int8_draft=True,
        prefix_cache_tokens=0,
        weights="auto",
    )
    assert EngineOptions.from_json(EngineOptions(**good).to_json(), "engine.json") == EngineOptions(**good)
    for bad, says in (
        (good | {"lookup": "true"}, "lookup must be of type bool"),
        (good | {"block_size": True}, "block_size must be of type int"),
        (good | {"speculation": "greedy"}, "--speculation must be one of"),
        (good | {"weights": "int4"}, "weights must be one of auto, bf16"),
        (good | {"draft_dir": ""}, "does not fit draft_dir"),
        (good | {"block_size": 0}, "does not fit draft_dir"),
        ({k: v for k, v in good.items() if k != "dtype"}, "not the engine options"),
    ):
        with pytest.raises(DFlashError, match=says):
            EngineOptions.from_json(json.dumps(bad), "engine.json")
    with pytest.raises(DFlashError, match="is not JSON"):
        EngineOptions.from_json("{", "engine.json")


def test_a_failed_build_leaves_the_previous_output_untouched(random_draft_dir, tmp_path, monkeypatch):
    out = tmp_path / "build"
    run_build(_opts(out, random_draft_dir), progress=lambda m: None)
    before = (out / "manifest.json").read_text()

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(build_module, "emit_repository", boom)
    with pytest.raises(RuntimeError):
        run_build(_opts(out, random_draft_dir, max_batch_size=3), progress=lambda m: None)
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]
    with pytest.raises(RuntimeError):
        run_build(_opts(tmp_path / "fresh", random_draft_dir), progress=lambda m: None)
    assert not (tmp_path / "fresh").exists()


def _edited_draft(src, dst, **dflash):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dflash_config"].update(dflash)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _no_tokenizer_target(target_dir, dst):
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.link(target_dir / name, dst / name)
    return dst


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "onnx"], "--backend must be one of torch, trtllm"),
        (["--backend", "torch", "--tp", "2"], "--tp needs --backend trtllm"),
        (["--backend", "torch", "--quant", "mxfp4"], "for MXFP4 use --backend trtllm"),
        (["--tp", "2"], "tp 2"),  # selects the TensorRT-LLM backend, where SmolLM2's 9 heads do not split in 2
        (["--quant", "int3"], "--quant must be one of"),
        (["--max-seq-len", "100000"], "exceeds the target's context window 8192"),
        (["--block-size", "99"], "exceeds the draft's trained block size 16"),
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--dtype", "fp8"], "--dtype must be one of auto, fp32, bf16"),
        (["--no-draft"], "contradict"),
        ("BAD_MASK", "mask_token_id 999999 is not a row"),
        ("FC_WIDTH", "fc.weight has shape"),
        ("NO_TOKENIZER", "has no tokenizer"),
        ("MISSING_DRAFT", "does not exist"),
    ],
)
def test_bad_build_input_is_one_sentence_and_writes_nothing(random_draft_dir, target_dir, tmp_path, args, message):
    out = tmp_path / "build"
    draft, target = str(random_draft_dir), "smollm2-135m"
    if args == "BAD_MASK":
        draft, args = str(_edited_draft(random_draft_dir, tmp_path / "bad", mask_token_id=999999)), []
    elif args == "FC_WIDTH":  # 3 taps in the config, an fc written for 2: caught from the safetensors header
        draft, args = str(_edited_draft(random_draft_dir, tmp_path / "bad", target_layer_ids=[1, 5, 9])), []
    elif args == "NO_TOKENIZER":
        target, args = str(_no_tokenizer_target(target_dir, tmp_path / "tgt")), []
    elif args == "MISSING_DRAFT":
        draft, args = str(tmp_path / "nope"), []
    r = CliRunner().invoke(main, ["build", "--target", target, "--draft", draft, "--output", str(out), *args])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Error: ") and message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_refuses_to_overwrite_a_directory_that_is_not_a_build(random_draft_dir, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = CliRunner().invoke(main, ["build", "--draft", str(random_draft_dir), "--output", str(tmp_path / "mine")])
    assert r.exit_code == 2 and "is not a trtdflash build" in r.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_serve_and_client_explain_what_is_wrong(tmp_path):
    r = CliRunner().invoke(main, ["serve", str(tmp_path)])
    assert r.exit_code == 2 and "is not a trtdflash build output" in r.output
    for prompt in (["--prompt", "hi"], ["hi"]):
        r = CliRunner().invoke(main, ["client", "--url", "127.0.0.1:1", *prompt])
        assert r.exit_code == 2 and "Cannot reach Triton at 127.0.0.1:1" in r.output


def test_serve_refuses_a_port_in_use(random_draft_dir, tmp_path):
    import socket

    out = run_build(_opts(tmp_path / "build", random_draft_dir), progress=lambda m: None)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = CliRunner().invoke(
            main, ["serve", str(out), "--grpc-port", str(port), "--http-port", "0", "--metrics-port", "0"]
        )
    assert r.exit_code == 2 and f"Cannot use 127.0.0.1:{port}" in r.output and "--grpc-port" in r.output


def test_a_drafts_card_travels_into_the_build_and_prices_the_servers_probes(random_draft_dir, tmp_path):
    """The shipped draft's training.json is staged beside its weights, and the engine the server loads from the build
    prices a probe with the card's held-out acceptance; a draft without a card gets the generic optimism."""
    out = tmp_path / "build"
    run_build(BuildOptions(output=out, max_seq_len=512), progress=lambda m: None)  # the packaged draft
    card = json.loads((out / "checkpoints/draft/training.json").read_text())
    engine = DFlashEngine.load(str(out / "checkpoints/target"), str(out / "checkpoints/draft"), progress=lambda m: None)
    assert engine.policy.ceiling == conditional_for_tau(card["final_metrics"]["val_tau"], engine.block_size)
    assert engine.policy.ceiling < OPTIMISTIC
    assert not (random_draft_dir / "training.json").exists()
    plain = DFlashEngine.load(str(out / "checkpoints/target"), str(random_draft_dir), progress=lambda m: None)
    assert plain.policy.ceiling == OPTIMISTIC
