"""`dynamo/` of a TensorRT-LLM build, judged by Dynamo's own files in the installed ai-dynamo wheel: the aggregated
TensorRT-LLM DynamoGraphDeployment template it ships, and the flags its `dynamo.trtllm` worker declares."""

import ast
import math
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from trtllm_dflash.cli import main
from trtllm_dflash.deploy.dynamo import DYNAMO_IMAGE, DYNAMO_TRTLLM, AisAcceptance
from trtllm_dflash.deploy.trtllm.schema import DFLASH_FIXES, FIRST_DFLASH_RELEASE, validate_llm_args


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamo") / "out"
    result = CliRunner().invoke(
        main, ["build", "--target", "gpt-oss-120b", "--tp", "8", "--replicas", "4", "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out


def _template() -> dict:
    return yaml.safe_load(
        (resources.files("dynamo") / "profiler" / "templates" / "dgd" / "trtllm" / "agg.yaml").read_text()
    )


def _worker_flags() -> dict[str, list | None]:
    """Every flag `python -m dynamo.trtllm` declares, read from the wheel's own source (it imports TensorRT-LLM, so it
    cannot be run here): flag name -> its choices (None: any value), obsolete aliases included."""
    tree = ast.parse((resources.files("dynamo") / "trtllm" / "backend_args.py").read_text())
    constants = {  # module-level NAME = "value"
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    flags: dict[str, list | None] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        for key in ("flag_name", "obsolete_flag"):
            if isinstance(kw.get(key), ast.Constant):
                choices = kw.get("choices")
                listed = None
                if isinstance(choices, ast.List):
                    listed = [constants.get(e.id) if isinstance(e, ast.Name) else None for e in choices.elts]
                flags[kw[key].value] = listed
    return flags


def test_engine_yaml_meets_the_rules_of_the_release_dynamos_image_carries(deployment):
    engine = yaml.safe_load((deployment / "dynamo/engine.yaml").read_text())
    validate_llm_args(engine, "dynamo/engine.yaml", DYNAMO_TRTLLM)
    serve = yaml.safe_load((deployment / "trtllm-serve.yaml").read_text())
    assert engine == serve  # the same deployment, whichever server runs it
    assert engine["speculative_config"]["decoding_type"] == "DFlash" and engine["tensor_parallel_size"] == 8


def test_the_graph_has_the_shape_of_dynamos_aggregated_trtllm_template(deployment):
    config_map, dgd = yaml.safe_load_all((deployment / "dynamo/graph.yaml").read_text())
    template = _template()
    assert (dgd["apiVersion"], dgd["kind"]) == (template["apiVersion"], template["kind"])
    ours = {c["type"]: c for c in dgd["spec"]["components"]}
    theirs = {c["type"]: c for c in template["spec"]["components"]}
    assert set(ours) == set(theirs) == {"frontend", "worker"}
    for kind, component in theirs.items():
        mine = ours[kind]
        assert mine["name"] == component["name"]
        (want,), (got,) = component["podTemplate"]["spec"]["containers"], mine["podTemplate"]["spec"]["containers"]
        assert got["name"] == want["name"] == "main"
        assert got["command"] == want["command"] and got["image"] == want["image"] == DYNAMO_IMAGE
        if kind == "frontend":
            assert got["args"] == want["args"]
            assert {"name": "DYN_ROUTER_MODE", "value": "kv"} in got["env"]
        assert got["envFrom"] == want["envFrom"]
    worker = ours["worker"]
    assert worker["replicas"] == 4
    (container,) = worker["podTemplate"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # engine.yaml reaches the worker where --extra-engine-args reads it: the ConfigMap's key, mounted by subPath
    args = container["args"]
    path = args[args.index("--extra-engine-args") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in worker["podTemplate"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] in config_map["data"]
    assert yaml.safe_load(config_map["data"][mount["subPath"]]) == yaml.safe_load(
        (deployment / "dynamo/engine.yaml").read_text()
    )


def test_every_worker_flag_is_one_dynamo_trtllm_declares(deployment):
    flags = _worker_flags()
    _, dgd = yaml.safe_load_all((deployment / "dynamo/graph.yaml").read_text())
    worker = next(c for c in dgd["spec"]["components"] if c["type"] == "worker")
    args = worker["podTemplate"]["spec"]["containers"][0]["args"]
    template_worker = next(c for c in _template()["spec"]["components"] if c["type"] == "worker")
    template_flags = [a for a in template_worker["podTemplate"]["spec"]["containers"][0]["args"] if a.startswith("--")]
    for flag in [a for a in args if a.startswith("--")] + template_flags:
        assert flag in flags, f"{flag} is not a dynamo.trtllm flag"
    mode = args[args.index("--disaggregation-mode") + 1]
    assert mode == "agg" and "agg" in flags["--disaggregation-mode"]
    launch = deployment / "dynamo/launch.sh"
    assert launch.stat().st_mode & 0o111 and subprocess.run(["bash", "-n", str(launch)]).returncode == 0
    text = launch.read_text()
    assert "need=32" in text and "--extra-engine-args dynamo/engine.yaml" in text and DYNAMO_IMAGE in text
    assert "--discovery-backend file --event-plane zmq" in text


def test_a_disaggregated_dynamo_mode_is_refused_with_a_draft(tmp_path):
    out = tmp_path / "out"
    args = ["build", "--target", "gpt-oss-120b", "--tp", "8", "--dynamo-mode", "disagg", "--output", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "drafts without the prompt" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_launch_sh_names_the_dflash_fixes_an_older_tensorrt_llm_lacks(deployment, tmp_path):
    """launch.sh's release check, run against a stand-in `tensorrt_llm` distribution of each version: refused before
    the first DFlash release, a warning naming each missing fix after it, silent on the fixes at the newest."""
    script = (deployment / "launch.sh").read_text()
    check = script.split("<<'CHECK' || exit 2\n", 1)[1].split("\nCHECK\n", 1)[0]
    oldest_fix = DFLASH_FIXES[0][0]

    def run(version: str) -> subprocess.CompletedProcess:
        site = tmp_path / version
        info = site / f"tensorrt_llm-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n")
        env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
        return subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)

    assert "1.3.0rc13 has no DFlash" in run("1.3.0rc13").stderr and run("1.3.0rc13").returncode
    early = run(FIRST_DFLASH_RELEASE)
    assert early.returncode == 0 and all(pr in early.stderr for _, pr, _ in DFLASH_FIXES)
    assert oldest_fix != FIRST_DFLASH_RELEASE
    late = run("1.4.0rc1")
    assert late.returncode == 0 and "lacks" not in late.stderr
    assert Path(deployment / "DEPLOY.md").read_text().count("tritonrelease_build") == 1


def test_serve_dynamo_refuses_a_tensorrt_llm_deployment_in_one_sentence(deployment):
    result = CliRunner().invoke(main, ["serve", str(deployment), "--dynamo"])
    assert result.exit_code == 2 and "is a TensorRT-LLM deployment: on GPUs run its dynamo/launch.sh" in result.output
    assert not (deployment / ".dynamo").exists()


def test_dynamos_acceptance_inputs_come_from_the_measured_profile(tmp_path, monkeypatch):
    """`build --acceptance-profile`: launch.sh and both graph components set DYN_AIS_NEXTN and
    DYN_AIS_NEXTN_ACCEPT_RATES from the profile, not Dynamo's default [0.85, 0.3, 0, 0, 0]; Dynamo's own option group
    reads them as `--ais-nextn-accept-rates`, and what its five positions leave out of a longer draft is stated."""
    import argparse
    import json

    from dynamo._internal.ais import _pad_nextn_accept_rates
    from dynamo.common.configuration.groups.ais_perf_args import AisPerfArgGroup

    rates = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
    profile = tmp_path / "speculation_profile.json"
    profile.write_text(json.dumps({"conditional": rates, "tau": 4.0, "conditions": {"dataset": "builtin"}}))
    out = tmp_path / "out"
    args = [
        "build",
        "--target",
        "gpt-oss-120b",
        "--tp",
        "8",
        "--acceptance-profile",
        str(profile),
        "--output",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    draft_len = yaml.safe_load((out / "dynamo" / "engine.yaml").read_text())["speculative_config"]["max_draft_len"]
    launch = (out / "dynamo" / "launch.sh").read_text()
    env = dict(line.removeprefix("export ").split("=", 1) for line in launch.splitlines() if "DYN_AIS" in line)
    env = {k: v.split(":-", 1)[1].rstrip("}") for k, v in env.items() if not k.startswith("#")}
    dgd = list(yaml.safe_load_all((out / "dynamo" / "graph.yaml").read_text()))[1]
    for component in dgd["spec"]["components"]:
        (container,) = component["podTemplate"]["spec"]["containers"]
        assert {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("DYN_AIS")} == env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    AisPerfArgGroup().add_arguments(parser)  # its defaults are read from DYN_AIS_* at this moment
    parsed = parser.parse_args([])
    n = min(draft_len, 5)
    assert parsed.ais_nextn == n and _pad_nextn_accept_rates(parsed.ais_nextn_accept_rates)[:n] == rates[:n]
    assert "from profile speculation_profile.json (builtin)" in launch and "left out" not in launch  # 3 positions
    longer = AisAcceptance.of(rates, 8, "a profile")
    left = sum(math.prod(rates[:j]) for j in range(6, 9))  # positions 6, 7 and 8 reached
    assert longer.nextn == 5 and longer.rates == tuple(rates[:5]) and math.isclose(longer.left_out, left)
    assert f"positions past the fifth, left out, would add {left:.2f} tokens per step" in longer.note()
