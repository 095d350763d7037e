"""`trtdflash gpu-check`: the one command an operator runs on a GPU host before trusting a deployment.

It builds the preset that fits the host on one GPU (gpt-oss-20b on Hopper and Blackwell) as a DFlash deployment
with its `--no-draft` twin, and such a pair per untested combination the default build replaced (`--opt-in`,
recipes.OPT_INS), the opt-ins first: an opt-in may change the numerics (an FP8 KV cache, another MoE kernel), so
each DFlash build is compared with a twin built the same way. It starts each with `./launch.sh` (Triton) and
`./launch.sh openai` (trtllm-serve) exactly as DEPLOY.md says, and checks per server:

  greedy    every prompt's greedy text equals the --no-draft twin's on the same launch path
  tau > 1   DFlash accepted drafts (Triton path: the ensemble's acceptance_length, pooled)
  counts    the draft counts are the engine's, not inferred from its iteration count
  finish    a short request ends "length", a stop word "stop"
  cancel    a stream left after its first response, and the next request still answers the same

On a GPU host each deployment is also served by NVIDIA Dynamo as DEPLOY.md says (`dynamo/launch.sh` inside Dynamo's
TensorRT-LLM image: its frontend, the KV router, one worker), where greedy, finish and cancel are checked through the
frontend's OpenAI API (tau and counts come from the Triton path of the same deployment: a frontend streams text).

The table is one PASS/FAIL row per deployment and path, with tau and tokens/s, saved as JSON. The default pair is also loaded at 1, 2, 4, ...
users, its DFlash deployment's speculation profile measured at one user on the built-in set, and its draft length by
load re-planned from both (calibrate.py, what `trtdflash plan --calibrate` does): the measurements, the profile and
the new schedule in the JSON, and the profile beside the deployment's files (`build --acceptance-profile` takes it). With `--engine embedded` (CI,
any CPU) the same code runs on a local target with our engine behind the LLM API and the tritonserver nvidia-pytriton bundles:
everything up to the engine swap. trtllm-serve exists only beside TensorRT-LLM, so the OpenAI path is skipped there.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trtllm_dflash.deploy.core import BuildOptions, make_plan, run_build
from trtllm_dflash.deploy.gpus import GPUS
from trtllm_dflash.errors import DFlashError

PROMPTS = (
    "What is 17 times 23? Answer with the number.",
    "Write a Python function that reverses a string.",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
)
ENGINE_ENV = "TRTDFLASH_LLM_ENGINE"  # = the tensorrt_llm Triton model's switch
LAUNCH = {  # each path as DEPLOY.md starts it, from the deployment's folder
    "triton": ["./launch.sh"],
    "openai": ["./launch.sh", "openai"],
    "dynamo": ["./dynamo/launch.sh"],
}
ARCH_RECIPE_GPU = {"hopper": "h100", "blackwell": "b200"}  # the one-GPU recipes' GPUs, by architecture
CALIBRATION_LOADS = 64  # the heaviest load the check measures for calibration (each level sends 4 requests per user)


@dataclass(frozen=True)
class CheckOptions:
    output: Path
    engine: str = "trtllm"  # trtllm: TensorRT-LLM on this host's GPU; embedded: our engine behind the LLM API (CPU)
    target: str | None = None  # a preset or a local checkpoint; None: the preset that fits this host's GPU
    draft: str | None = None  # None: the preset's
    gpu: str | None = None  # the recipe's GPU; None: this host's
    max_tokens: int = 96
    prompts: tuple[str, ...] = PROMPTS
    startup_timeout: float = 1800.0  # a first start on a GPU host downloads the weights


@dataclass
class Row:
    variant: str
    path: str  # triton | openai
    checks: dict[str, bool | None] = field(default_factory=dict)  # None: not applicable on this path
    tau: float = 0.0
    tokens_per_second: float = 0.0
    note: str = ""

    @property
    def passed(self) -> bool:
        return all(v is not False for v in self.checks.values())


def host_gpu() -> tuple[str, int]:
    """(our name of this host's GPU, how many) from nvidia-smi."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        raise DFlashError(
            "nvidia-smi finds no GPU here; run the GPU check on a GPU host, or pass --engine embedded."
        ) from None
    names = [n.strip().lower() for n in names if n.strip()]
    known = (
        [g for g in sorted(GPUS, key=len, reverse=True) if g in names[0].replace(" ", "").replace("-", "")]
        if names
        else []
    )
    if not known:
        raise DFlashError(f"The GPU check knows no recipe GPU in {names[0] if names else 'nothing'!r}; pass --gpu.")
    return known[0], len(names)


def pick_target(gpu: str) -> tuple[str, str]:
    """(preset, recipe GPU) for one GPU of this kind."""
    arch = GPUS[gpu].architecture
    if arch not in ARCH_RECIPE_GPU:
        raise DFlashError(f"No one-GPU DFlash recipe for {gpu} ({arch}); the presets run on Hopper and Blackwell.")
    return "gpt-oss-20b", ARCH_RECIPE_GPU[arch]


def _pairs(opts: CheckOptions, base: BuildOptions) -> list[tuple[str, BuildOptions, BuildOptions]]:
    """(label, DFlash build, its --no-draft twin): each opt-in the default build replaced, then the default."""
    replaced = make_plan(base, progress=lambda m: None).deployment.replaced
    pairs = []
    for label, opt_in in [(f"opt-in {name}", (name,)) for name in replaced] + [("default", ())]:
        folder = opts.output / label.replace(" ", "-")
        dflash = BuildOptions(**{**asdict(base), "output": folder / "dflash", "opt_in": opt_in})
        pairs.append(
            (
                label,
                dflash,
                BuildOptions(**{**asdict(dflash), "output": folder / "no-draft", "draft": None, "no_draft": True}),
            )
        )
    return pairs


class Launched:
    """`./launch.sh [openai]` of one deployment on free ports; stops its process group on exit."""

    def __init__(self, deployment: Path, path: str, env: dict[str, str], timeout: float):
        from trtllm_dflash.serving.serve import free_ports

        self.ports = dict(zip(("HTTP_PORT", "GRPC_PORT", "METRICS_PORT"), free_ports(3)))
        self.log = deployment / f"{path}.log"
        with open(self.log, "wb") as log:
            args = LAUNCH[path]
            self.proc = subprocess.Popen(
                args,
                cwd=deployment,
                env={**env, **{k: str(v) for k, v in self.ports.items()}},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        health = {"openai": "/health", "triton": "/v2/health/ready", "dynamo": "/v1/models"}[path]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise DFlashError(
                    f"{deployment.name}: `{shlex.join(args)}` exited with {self.proc.returncode}; see {self.log}."
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['HTTP_PORT']}{health}", timeout=2) as r:
                    # Dynamo's frontend answers before a worker registers; its model list says when one has
                    if r.status == 200 and (path != "dynamo" or json.loads(r.read()).get("data")):
                        return
            except (OSError, ValueError):
                pass
            time.sleep(1)
        self.stop()
        raise DFlashError(f"{deployment.name}: `{shlex.join(args)}` was not ready in {timeout:.0f} s; see {self.log}.")

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports['GRPC_PORT']}"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['HTTP_PORT']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _triton_row(row: Row, server: Launched, opts: CheckOptions, reference: dict | None) -> list[str]:
    from trtllm_dflash.clients.client import CompletionRequest, complete
    from trtllm_dflash.clients.loadgen import Job, run_load

    done = [complete(server.url, CompletionRequest(p, opts.max_tokens, True), timeout=600) for p in opts.prompts]
    texts = [d.text for d in done]
    drafting = reference is not None  # the twin, which has no draft, runs first and gives the reference
    row.checks["greedy"] = None if reference is None else texts == reference.get("triton")
    decoded = sum(d.num_tokens - 1 for d in done)
    verifies = sum((d.num_tokens - 1) / d.acceptance_length for d in done if d.acceptance_length)
    row.tau = decoded / verifies if verifies else 0.0  # pooled: every prompt's tokens over every prompt's verifies
    row.checks["tau > 1"] = row.tau > 1 if drafting else None
    row.checks["counts"] = (
        all(not d.draft_counts_estimated and d.drafted_tokens > 0 for d in done) if drafting else None
    )
    row.tokens_per_second = sum(d.num_tokens for d in done) / max(sum(d.wall_time for d in done), 1e-9)
    short = complete(server.url, CompletionRequest(opts.prompts[0], 4, True), timeout=600)
    stop_word = texts[1].split()[1] if len(texts[1].split()) > 1 else None
    stopped = (
        complete(
            server.url, CompletionRequest(opts.prompts[1], opts.max_tokens, True, stop_words=(stop_word,)), timeout=600
        )
        if stop_word
        else None
    )
    row.checks["finish"] = short.finish_reason == "length" and (stopped is None or stopped.finish_reason == "stop")
    left = run_load(server.url, [Job(opts.prompts[2], opts.max_tokens, leave_after=1)], 1).outcomes[0]
    again = complete(server.url, CompletionRequest(opts.prompts[2], opts.max_tokens, True), timeout=600)
    row.checks["cancel"] = left.left and not left.error and again.text == texts[2]
    return texts


def _finish_reason(url: str, prompt: str, max_tokens: int, stop: str | None = None) -> str | None:
    """One greedy chat completion through an OpenAI API, unstreamed: its finish_reason."""
    from trtllm_dflash.clients.loadgen import openai_base, openai_model

    body = {"model": openai_model(url), "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body |= {"temperature": 0.0} | ({"stop": [stop]} if stop else {})
    request = urllib.request.Request(
        openai_base(url) + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.load(r)["choices"][0].get("finish_reason")


def _openai_row(row: Row, server: Launched, opts: CheckOptions, reference: dict | None) -> list[str]:
    """trtllm-serve's or Dynamo's frontend's OpenAI API (row.path): greedy identity with the twin on the same path, the
    finish reasons, a stream left after its first chunk."""
    from trtllm_dflash.clients.loadgen import Job, run_load

    run = run_load(server.openai_url, [Job(p, opts.max_tokens, stream=True) for p in opts.prompts], 1)
    errors = [o.error for o in run.outcomes if o.error]
    if errors:
        raise DFlashError(f"{row.variant}: the {row.path} path failed a request: {errors[0]}")
    texts = [o.text for o in run.outcomes]
    row.checks["greedy"] = None if reference is None else texts == reference.get(row.path)
    row.tokens_per_second = sum(o.tokens for o in run.outcomes) / max(sum(o.latency for o in run.outcomes), 1e-9)
    words = texts[1].split()
    row.checks["finish"] = _finish_reason(server.openai_url, opts.prompts[0], 4) == "length" and (
        len(words) < 2 or _finish_reason(server.openai_url, opts.prompts[1], opts.max_tokens, words[1]) == "stop"
    )
    left = run_load(server.openai_url, [Job(opts.prompts[2], opts.max_tokens, leave_after=1)], 1).outcomes[0]
    again = run_load(server.openai_url, [Job(opts.prompts[2], opts.max_tokens)], 1).outcomes[0]
    row.checks["cancel"] = left.left and not again.error and again.text == texts[2]
    return texts


def _load_levels(server: Launched, opts: CheckOptions, deployment: Path, progress) -> tuple[str, list[dict]] | None:
    """The server of `deployment` under closed-loop load (loadgen.compare) at the loads calibration measures: on a GPU,
    1, 2, 4, ... up to its max_batch_size or CALIBRATION_LOADS; with the embedded engine one user, two requests (it
    serves requests in turn, not batched: only the code path is checked). None where the load failed."""
    from trtllm_dflash.clients.loadgen import compare
    from trtllm_dflash.deploy.core import read_build
    from trtllm_dflash.engine.plan import batch_sizes

    top = min(read_build(deployment)["resolved"]["max_batch_size"], CALIBRATION_LOADS)
    levels = [1] if opts.engine == "embedded" else batch_sizes(top)
    progress(f"gpu-check: load at {levels} users, for calibration")
    requests = 2 if opts.engine == "embedded" else 0
    try:
        measured = compare(
            {"server": server.url},
            list(opts.prompts),
            levels,
            max_tokens=opts.max_tokens,
            requests=requests,
            progress=progress,
        )
    except DFlashError as e:  # the checks stand without it
        progress(f"gpu-check: the load for calibration failed: {e}")
        return None
    return server.url, measured["server"]


def _profile(server: Launched, opts: CheckOptions, progress) -> dict | None:
    """The DFlash deployment's speculation profile at one user on the built-in set (bench.measure_profile); with
    the embedded engine one record per category. None where it failed: the checks stand without it."""
    from trtllm_dflash.clients.bench import PROFILE_RECORDS, measure_profile

    progress("gpu-check: the draft's acceptance per position at 1 user, on the built-in set")
    try:
        records = PROFILE_RECORDS // 2 if opts.engine == "embedded" else PROFILE_RECORDS
        return measure_profile(server.url, max_tokens=opts.max_tokens, records=records, server="gpu-check")
    except DFlashError as e:
        progress(f"gpu-check: the speculation profile failed: {e}")
        return None


def _calibration(deployment: Path, loads: dict[str, tuple[str, list[dict]]], profile: dict | None, progress) -> dict:
    """The default DFlash deployment's draft length by load re-planned from the loads measured on it and its twin and
    its speculation profile (calibrate.replan, rewriting its files and writing the profile beside them as `trtdflash
    plan --calibrate` would); an error is recorded, not raised: the checks stand on their own."""
    from trtllm_dflash.deploy.calibrate import replan

    try:
        result = replan(
            deployment,
            {role: levels for role, (_, levels) in loads.items()},
            {r: u for r, (u, _) in loads.items()},
            profile=profile,
        )
    except DFlashError as e:
        progress(f"gpu-check: calibration failed: {e}")
        return {"error": str(e)}
    progress(f"gpu-check: the draft length by load, calibrated on this host ({deployment}):\n{result.table()}")
    return result.record()


def _environment(opts: CheckOptions) -> dict[str, str]:
    """launch.sh's environment: as it is on a GPU host; with the embedded engine, nvidia-pytriton's tritonserver on PATH."""
    env = {k: v for k, v in os.environ.items() if k != ENGINE_ENV}
    if opts.engine != "embedded":
        return env
    from trtllm_dflash.serving.serve import locate_tritonserver

    binary, backends, extra = locate_tritonserver()
    shim = opts.output / "bin" / "tritonserver"
    shim.parent.mkdir(parents=True, exist_ok=True)
    flags = f" --backend-directory={shlex.quote(str(backends))}" if backends else ""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in extra.items() if k != "PATH")
    shim.write_text(f'#!/bin/sh\n{exports}exec {shlex.quote(str(binary))}{flags} --allow-gpu-metrics=false "$@"\n')
    shim.chmod(0o755)
    return {
        **env,
        ENGINE_ENV: "embedded",
        "PATH": os.pathsep.join((str(shim.parent), str(Path(sys.executable).parent), env["PATH"])),
    }


def available_paths(progress) -> tuple[str, ...]:
    """The launch paths this container can run: no published image has all three (Triton's beside a TensorRT-LLM with
    DFlash none at all; DEPLOY.md), so each is checked where it runs and the rest are named."""
    import importlib.util
    import shutil

    runs = {
        "triton": shutil.which("tritonserver") is not None,
        "openai": shutil.which("trtllm-serve") is not None,
        "dynamo": importlib.util.find_spec("dynamo") is not None
        and importlib.util.find_spec("dynamo.trtllm") is not None,
    }
    paths = tuple(p for p, ok in runs.items() if ok)
    if not paths:
        raise DFlashError(
            "This container has no tritonserver, no trtllm-serve and no dynamo.trtllm; run the GPU check inside the "
            "TensorRT-LLM release image or Dynamo's TensorRT-LLM image (DEPLOY.md)."
        )
    skipped = [p for p, ok in runs.items() if not ok]
    if skipped:
        progress(f"gpu-check: not in this container, so not checked here: {', '.join(skipped)} (DEPLOY.md's images)")
    return paths


def run_check(opts: CheckOptions, progress: Callable[[str], None] = print) -> list[Row]:
    """Build, launch and check every variant on every path; writes gpu-check.json into opts.output."""
    if opts.engine not in ("trtllm", "embedded"):
        raise DFlashError(f"--engine must be trtllm or embedded, got {opts.engine!r}.")
    if opts.engine == "embedded" and not (opts.target and (Path(opts.target).expanduser() / "config.json").is_file()):
        raise DFlashError(
            "--engine embedded needs --target DIR, a local checkpoint: the embedded engine runs it on CPU."
        )
    if opts.engine == "trtllm":
        gpu, _ = host_gpu()
        preset, recipe_gpu = pick_target(gpu)
        target, gpu = opts.target or preset, opts.gpu or recipe_gpu
        paths = available_paths(progress)
    else:
        target, gpu, paths = opts.target, opts.gpu, ("triton",)
    opts.output.mkdir(parents=True, exist_ok=True)
    base = BuildOptions(
        output=opts.output / "dflash",
        target=target,
        draft=opts.draft,
        backend="trtllm",
        gpu=gpu,
        max_batch_size=4 if opts.engine == "embedded" else None,
        max_seq_len=1024 if opts.engine == "embedded" else None,
    )
    env, rows, loads, profile = _environment(opts), [], {}, None
    for label, dflash, twin in _pairs(opts, base):
        reference = None
        for role, name, build in (("twin", f"{label}, no draft", twin), ("deployment", label, dflash)):
            progress(f"gpu-check: building {name} ({build.output})")
            run_build(build, progress=lambda m: None)
            texts = {}
            for path in paths:
                row = Row(name, path)
                progress(f"gpu-check: {name} through {shlex.join(LAUNCH[path])}")
                try:
                    with Launched(build.output, path, env, opts.startup_timeout) as server:
                        texts[path] = (_triton_row if path == "triton" else _openai_row)(row, server, opts, reference)
                        if label == "default" and path == "triton":
                            calibrated = dflash.output
                            loads[role] = _load_levels(server, opts, build.output, progress)
                            if role == "deployment":
                                profile = _profile(server, opts, progress)
                except DFlashError as e:
                    row.checks["started"], row.note = False, str(e)
                rows.append(row)
            reference = texts
    measured = {role: load for role, load in loads.items() if load is not None}
    calibration = _calibration(calibrated, measured, profile, progress) if len(measured) == 2 else None
    (opts.output / "gpu-check.json").write_text(
        json.dumps(
            {
                "target": target,
                "gpu": gpu,
                "engine": opts.engine,
                "passed": all(r.passed for r in rows),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "rows": [asdict(r) for r in rows],
                "calibration": calibration,
                "profile": profile,
            },
            indent=2,
        )
        + "\n"
    )
    return rows


def table(rows: list[Row]) -> str:
    names = list(dict.fromkeys(k for r in rows for k in r.checks))
    mark = {True: "ok", False: "FAIL", None: "-"}
    lines = [
        f"{'deployment':<30} {'path':<7} " + " ".join(f"{n:>8}" for n in names) + f" {'tau':>6} {'tok/s':>8}  verdict"
    ]
    for r in rows:
        lines.append(
            f"{r.variant:<30} {r.path:<7} "
            + " ".join(f"{mark[r.checks.get(n)]:>8}" for n in names)
            + f" {r.tau:>6.2f} {r.tokens_per_second:>8.1f}  {'PASS' if r.passed else 'FAIL'}"
            + (f"  {r.note}" if r.note else "")
        )
    return "\n".join(lines)
