"""The acceptance gate (`trtdflash bench --gate`): a DFlash deployment against its --no-draft twin on the user's own
prompts, both served by the real tritonserver; it passes and records its verdict in the DFlash build's manifest, and
fails (exit 1, one sentence) where the first server is the slower, as the twin named first is."""

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.clients.bench import T95, gate_failure, gate_verdict, paired_speedup
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.resolve import sha256_file
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

TRTDFLASH = str(Path(sys.executable).parent / "trtdflash")
MATH = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did she sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
]


def _level(concurrency: int, speed: float, errors: int = 0) -> dict:
    return {
        "concurrency": concurrency,
        "steady_tokens_per_s": speed,
        "total_tokens_per_s": speed,
        "acceptance_length_median": 2.0,
        "errors": ["e"] * errors,
    }


def test_one_round_is_judged_by_its_ratio_alone():
    assert gate_verdict({"d": [_level(1, 20), _level(8, 10)], "t": [_level(1, 10), _level(8, 10)]})["passed"]
    lost = gate_verdict({"d": [_level(1, 20), _level(8, 9)], "t": [_level(1, 10), _level(8, 10)]})
    assert not lost["passed"] and [lv["speedup"] for lv in lost["levels"]] == [2.0, 0.9]
    assert [lv["verdict"] for lv in lost["levels"]] == ["faster", "slower"] and lost["levels"][1]["bounds"] is None
    assert gate_failure(lost) == "DFlash is 0.90x its draft-free twin at 8 users"
    assert not gate_verdict({"d": [_level(1, 20, errors=1)], "t": [_level(1, 10)]})["passed"]


def _rounds(dflash: list[float], twin: list[float]) -> dict:
    d = _level(16, statistics.median(dflash)) | {"steady_tokens_per_s_rounds": dflash}
    t = _level(16, statistics.median(twin)) | {"steady_tokens_per_s_rounds": twin}
    return gate_verdict({"d": [d], "t": [t]})


def test_rounds_are_paired_and_a_level_loses_only_beyond_their_spread():
    """The machine slowed in the second round and sped up in the third. Behind by 3 % in every round, steadily: a
    loss, although each build's median round (78, 80) is within 3 % too. Ahead in two rounds and behind in one, by as
    much as the same build against itself varies: within noise, and the gate passes. Ahead by 5 % in every round:
    faster."""
    lost = _rounds([97.2, 58.1, 77.6], [100.0, 60.0, 80.0])
    level = lost["levels"][0]
    assert not lost["passed"] and level["verdict"] == "slower" and level["bounds"][1] < 1.0
    assert level["speedup"] == 0.97 and level["rounds"] == 3
    assert gate_failure(lost).startswith("DFlash is 0.97x its draft-free twin at 16 users, at most 0.9")
    tie = _rounds([100.0, 60.0, 80.0], [98.0, 59.0, 85.0])
    assert tie["passed"] and tie["levels"][0]["verdict"] == "within noise" and gate_failure(tie) is None
    low, high = tie["levels"][0]["bounds"]
    assert low < tie["levels"][0]["speedup"] < 1.0 < high
    won = _rounds([105.0, 63.0, 84.0], [100.0, 60.0, 80.0])
    assert won["passed"] and won["levels"][0]["verdict"] == "faster" and won["levels"][0]["speedup"] == 1.05


def test_the_bounds_are_students_over_the_ratios_logarithms():
    """Against scipy's t distribution, which the package does not depend on."""
    stats = pytest.importorskip("scipy.stats")
    ratios = [0.95, 1.01, 0.98, 1.04, 0.97]
    logs = [math.log(r) for r in ratios]
    mean, sem = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    half = stats.t.ppf(0.95, len(logs) - 1) * sem
    speedup, (low, high) = paired_speedup(ratios)
    assert speedup == pytest.approx(math.exp(mean))
    assert low == pytest.approx(math.exp(mean - half), rel=1e-4) and high == pytest.approx(
        math.exp(mean + half), rel=1e-4
    )
    for df, t in enumerate(T95, 1):
        assert t == pytest.approx(stats.t.ppf(0.95, df), abs=6e-4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gate", "--url", "127.0.0.1:1"], "give exactly two --url"),
        (["--deployment", "."], "pass --gate with it"),
        (["--gate", "--url", "a=127.0.0.1:1", "--url", "b=127.0.0.1:2", "--deployment", "."], "not a trtdflash build"),
    ],
)
def test_bad_gate_input_gets_one_sentence(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output, r.output


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The packaged SmolLM2 deployment and its --no-draft twin, served side by side."""
    root = tmp_path_factory.mktemp("gate")
    builds = {
        name: run_build(
            BuildOptions(output=root / name, no_draft=name == "twin", max_seq_len=512, max_batch_size=2),
            progress=lambda m: None,
        )
        for name in ("dflash", "twin")
    }
    servers = {}
    try:
        for name, build in builds.items():
            servers[name] = TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0)).start()
        yield builds, servers
    finally:
        for s in servers.values():
            s.stop()


def _gate(first, second, prompts, deployment=None, levels="1,2"):
    args = [TRTDFLASH, "bench", "--gate", "--url", f"first={first.grpc_url}", "--url", f"second={second.grpc_url}"]
    args += ["--concurrency", levels, "--requests", "4", "--max-tokens", "48", "--prompts", str(prompts)]
    args += ["--deployment", str(deployment)] if deployment else []
    return subprocess.run(args, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_gate_passes_records_its_verdict_and_fails_the_slower_server_first(pair, tmp_path):
    (builds, servers), prompts = pair, tmp_path / "math.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in MATH))
    # One user: where DFlash won on every CPU measured; at two, bf16 on an AVX2-only CPU measured 0.98x (the gate was right).
    passed = _gate(servers["dflash"], servers["twin"], prompts, deployment=builds["dflash"], levels="1")
    assert passed.returncode == 0, passed.stderr
    assert "Gate passed" in passed.stdout
    verdict = json.loads((builds["dflash"] / "manifest.json").read_text())["acceptance_gate"]
    assert verdict["passed"] and [lv["concurrency"] for lv in verdict["levels"]] == [1]
    assert all(lv["speedup"] > 1.0 and lv["tau"] > 1.0 and lv["errors"] == 0 for lv in verdict["levels"])
    assert len(verdict["prompts_sha256"]) == 64 and verdict["date"] and verdict["machine"]
    failed = _gate(servers["twin"], servers["dflash"], prompts)
    assert failed.returncode == 1 and "Gate failed" in failed.stderr and "Traceback" not in failed.stderr


def _verify_on(tmp_path, prompts, *args):
    out = tmp_path / "built"
    argv = ["build", "--output", str(out), "--max-seq-len", "512", "--verify-on", str(prompts), *args]
    return CliRunner().invoke(main, argv), out


@pytest.mark.slow
def test_build_verify_on_writes_a_build_that_passes_and_nothing_where_dflash_loses(tmp_path, random_draft_dir):
    """`build --verify-on`: the same gate against the build's twin before anything is written. The packaged draft
    passes and the verdict is in the new build's manifest; a random draft verified a whole block every step loses, and
    the output is not created."""
    prompts = tmp_path / "math.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in MATH))
    r, out = _verify_on(tmp_path, prompts, "--max-batch-size", "2", "--verify-concurrency", "1")
    assert r.exit_code == 0, r.output
    verdict = json.loads((out / "manifest.json").read_text())["acceptance_gate"]
    assert verdict["passed"] and [lv["concurrency"] for lv in verdict["levels"]] == [1]
    assert verdict["levels"][0]["speedup"] > 1.0 and verdict["levels"][0]["errors"] == 0
    shutil.rmtree(out)
    args = ["--draft", str(random_draft_dir), "--speculation", "fixed", "--max-batch-size", "1"]  # levels: 1
    r, out = _verify_on(tmp_path, prompts, *args)
    assert r.exit_code != 0 and "--verify-on: DFlash is 0." in r.output and "nothing was written" in r.output
    assert "Traceback" not in r.output and not out.exists()


def test_verify_on_refuses_what_it_cannot_judge(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    for args, message in (
        (["--no-draft"], "a --no-draft build has none"),
        (["--gpu", "h200"], "run `trtdflash bench --gate`"),
        (["--verify-concurrency", "0"], "must be positive"),
        (["--verify-concurrency", "a"], "separated by commas"),
        (["--verify-rounds", "1"], "1 is not in the range x>=2"),
    ):
        r, out = _verify_on(tmp_path, prompts, *args)
        assert r.exit_code == 2 and message in r.output and not out.exists(), r.output
    r, out = _verify_on(tmp_path, tmp_path / "missing.jsonl")
    assert r.exit_code == 2 and "no such file" in r.output and not out.exists()


@pytest.mark.slow
def test_calibration_replans_a_deployment_from_the_steps_its_servers_show(pair, trtllm_deployment, tmp_path):
    """`trtdflash plan --calibrate`: the real tritonserver serving the embedded SmolLM2 build and its twin stands in for
    the TensorRT-LLM deployment's servers (it cannot run here), so this checks measuring, fitting, planning, validating
    and writing, not that a GPU's steps fit its roofline (they cannot: the warning says so). The files are rewritten
    with a schedule TensorRT-LLM's own rules accept, the manifest records what was measured and still vouches for the
    files (a rebuild finds them intact), and --dry-run writes nothing."""
    import os

    import yaml

    from trtllm_dflash.deploy.calibrate import read_deployment
    from trtllm_dflash.deploy.schedule import CONTEXT, roofline_parts
    from trtllm_dflash.deploy.trtllm.schema import upstream_errors

    _, servers = pair
    deployment = tmp_path / "deployment"
    shutil.copytree(trtllm_deployment, deployment, copy_function=os.link)  # the session's build stays as it was
    args = ["plan", str(deployment), "--calibrate", servers["dflash"].grpc_url, "--twin", servers["twin"].grpc_url]
    args += ["--requests", "4", "--max-tokens", "32"]
    files = {p: p.read_bytes() for p in deployment.rglob("*") if p.is_file()}
    dry = CliRunner().invoke(main, [*args, "--dry-run"])
    assert dry.exit_code == 0 and "Re-planned" in dry.output, dry.output
    assert {p: p.read_bytes() for p in deployment.rglob("*") if p.is_file()} == files
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "restart the servers" in r.output and "the roofline's" in r.output, r.output
    record = json.loads((deployment / "manifest.json").read_text())["calibration"]
    assert [p["batch"] for p in record["points"]] == [1, 2] and record["points"][0]["draft_len"] == 3
    # the acceptance per position, measured at 1 user on the built-in set, is kept beside the files and planned with
    profile = json.loads((deployment / "speculation_profile.json").read_text())
    assert profile["conditions"]["records"] == 22 and profile["conditional"] and profile["tau"] > 1
    assert record["acceptance"].startswith("measured per position (builtin, single-turn, 22 records)")
    assert all(p["step_s"] > 0 and p["twin_step_s"] > 0 for p in record["points"]) and record["points"][0]["tau"] > 1
    # the scaled roofline goes through every measured step (or above it, where noise left drafting no time)
    recipe = read_deployment(deployment)[3]
    parts = roofline_parts(recipe, min(CONTEXT, recipe.max_seq_len))
    for point in record["points"]:
        b, k = point["batch"], point["draft_len"]
        sv, sd = record["scales"][str(b)]
        assert sv > 0 and sd > 0 and sv * parts(b, 0)[0] == pytest.approx(point["twin_step_s"], rel=1e-6)
        assert sv * parts(b, k)[0] + sd * parts(b, k)[1] >= point["step_s"] * (1 - 1e-6)
    for rel in ("triton_repo/tensorrt_llm/1/model.yaml", "trtllm-serve.yaml"):
        spec = yaml.safe_load((deployment / rel).read_text())["speculative_config"]
        assert {str(k): v for k, v in spec["draft_len_schedule"].items()} == record["draft_len_schedule"]
        assert spec["max_draft_len"] == record["planned"][0]["draft_len"] and not upstream_errors(
            {"speculative_config": spec}
        )
    options = json.loads((deployment / "manifest.json").read_text())["options"]
    run_build(BuildOptions(**options | {"output": deployment, "opt_in": ()}), progress=lambda m: None)
    rebuilt = json.loads((deployment / "manifest.json").read_text())
    assert rebuilt["calibration"] == record  # the files it rewrote were reused, and it still vouches for them
    for rel, meta in rebuilt["steps"]["engine_options"]["outputs"].items():
        assert meta["sha256"] == sha256_file(deployment / rel), rel


@pytest.mark.slow
def test_bench_reads_each_servers_throughput_at_a_per_user_speed_off_its_curve(pair, tmp_path):
    """`bench --interactivity` on two real servers: the readout printed and kept in the results JSON is the one the
    measured levels give (interactivity.readout), a speed no level reached says so, and the plot marks each target."""
    from trtllm_dflash.clients.interactivity import readout

    (_, servers), out = pair, tmp_path / "bench.json"
    args = [
        TRTDFLASH,
        "bench",
        "--url",
        f"dflash={servers['dflash'].grpc_url}",
        "--url",
        f"twin={servers['twin'].grpc_url}",
    ]
    args += ["--concurrency", "1,2", "--requests", "4", "--max-tokens", "32", "--interactivity", "1e9"]
    args += ["--output", str(out)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    first = [lv["tokens_per_s_per_user"] for lv in report["levels"]["dflash"]]
    target = sum(first) / 2  # between the two measured levels of the first server: always read
    assert report["interactivity"] == readout(report["levels"], [1e9])
    assert report["interactivity"][0]["throughput"] == {"dflash": None, "twin": None}
    assert "Throughput at a per-user speed" in run.stdout and "not reached" in run.stdout
    at = readout(report["levels"], [target])[0]["throughput"]["dflash"]
    steady = sorted(lv["steady_tokens_per_s"] for lv in report["levels"]["dflash"])
    assert at is not None and steady[0] <= at <= steady[-1]
    assert out.with_suffix(".png").stat().st_size > 0
