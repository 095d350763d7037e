"""`trtdflash gpu-check`'s CPU half: every deployment it builds launched through ./launch.sh with the embedded engine
behind the LLM API, every check it runs on a GPU host run here (the OpenAI path needs trtllm-serve: GPU only)."""

import json

import pytest
import yaml
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.deploy.gpu_check import CheckOptions, run_check, table

pytestmark = pytest.mark.slow


def test_the_cpu_half_passes_every_check(target_dir, tmp_path):
    rows = run_check(
        CheckOptions(
            tmp_path / "check", engine="embedded", target=str(target_dir), draft="smollm2-135m", max_tokens=24
        ),
        progress=lambda m: None,
    )
    # the local target's one untested combination (KV block reuse) is tried as an opt-in pair, then the default pair
    assert [(r.variant, r.path) for r in rows] == [
        ("opt-in block-reuse, no draft", "triton"),
        ("opt-in block-reuse", "triton"),
        ("default, no draft", "triton"),
        ("default", "triton"),
    ]
    assert all(r.passed for r in rows), table(rows)
    dflash = rows[-1]
    assert dflash.checks == {"greedy": True, "tau > 1": True, "counts": True, "finish": True, "cancel": True}
    assert dflash.tau > 1 and dflash.tokens_per_second > 0 and rows[-2].tau == pytest.approx(1.0)
    saved = json.loads((tmp_path / "check/gpu-check.json").read_text())
    assert saved["passed"] and saved["engine"] == "embedded" and len(saved["rows"]) == 4
    # the default pair under load, and its deployment's draft length by load re-planned from it (calibrate.replan)
    calibration, deployment = saved["calibration"], tmp_path / "check/default/dflash"
    assert [p["batch"] for p in calibration["points"]] == [1], calibration
    point = calibration["points"][0]
    assert point["draft_len"] > 0 and point["tau"] > 1 and point["step_s"] > 0 and point["twin_step_s"] > 0
    assert (
        json.loads((deployment / "manifest.json").read_text())["calibration"]["draft_len_schedule"]
        == (calibration["draft_len_schedule"])
    )
    spec = yaml.safe_load((deployment / "trtllm-serve.yaml").read_text())["speculative_config"]
    assert {str(k): v for k, v in spec["draft_len_schedule"].items()} == calibration["draft_len_schedule"]
    # its speculation profile, measured on the host, planned the acceptance and sits beside its files
    profile = saved["profile"]
    assert profile["conditions"]["records"] == 11 and profile["tau"] > 1 and profile["conditional"]
    assert json.loads((deployment / "speculation_profile.json").read_text()) == profile
    assert calibration["acceptance"].startswith("measured per position (builtin, single-turn, 11 records)")


def test_bad_input_is_one_sentence(tmp_path):
    result = CliRunner().invoke(main, ["gpu-check", "--engine", "embedded", "--output", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--engine embedded needs --target DIR" in result.output
