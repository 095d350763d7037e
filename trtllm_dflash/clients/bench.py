"""`trtdflash bench`: load one or more running servers as `vllm bench serve` and `genai-perf` do, for an operator
who has deployed a build (on GPUs, or the embedded one) and wants its throughput, latency and acceptance per
concurrency level, or deployments side by side: a DFlash build and the same build without a draft, or a peer
(vLLM, SGLang, trtllm-serve) through its OpenAI-compatible API on the same GPUs.

The servers take turns level by level (`loadgen.compare`); the figures are measured at the client, as a user sees
them, so the results file records the client's CPU and the servers' addresses, not the servers' hardware.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from trtllm_dflash.atomic import write_json
from trtllm_dflash.clients.loadgen import check_levels, compare, default_prompts, plot_pareto
from trtllm_dflash.errors import DFlashError

VERIFY_TOKENS = 64  # tokens per request of `build --verify-on`'s gate


def parse_urls(urls: tuple[str, ...] | list[str]) -> dict[str, str]:
    """NAME=URL or URL (named by itself), in the order given; URL is HOST:PORT (Triton's gRPC) or http(s)://... (OpenAI)."""
    out: dict[str, str] = {}
    for spec in urls:
        name, sep, url = spec.partition("=")
        if not sep:
            name, url = spec, spec
        if not name or not url:
            raise DFlashError(
                f"--url {spec!r}: give URL or NAME=URL (HOST:PORT for Triton's gRPC, http://HOST:PORT for OpenAI's API)."
            )
        if name in out:
            raise DFlashError(f"--url names {name!r} twice; give each server its own NAME=URL.")
        out[name] = url
    return out


def read_prompts(path: str) -> list[str]:
    """One prompt per line, or JSON lines with a "prompt" field (as vLLM's and genai-perf's input files carry)."""
    p = Path(path)
    if not p.is_file():
        raise DFlashError(f"--prompts {path}: no such file.")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DFlashError(f"--prompts {path} is not UTF-8 text.") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DFlashError(f"--prompts {path}, line {n}: not valid JSON.") from None
            if not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise DFlashError(f'--prompts {path}, line {n}: a JSON line needs a non-empty "prompt" string.')
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise DFlashError(f"--prompts {path} holds no prompts.")
    return prompts


def table(levels: dict[str, list[dict]]) -> str:
    """One row per level and server; with several servers, the first one's steady tokens/s over each other's (list the
    DFlash build first: its speed-up)."""
    names = list(levels)
    width = max(8, *map(len, names))
    head = (
        f"{'users':>5}  {'server':<{width}}  {'tok/s':>7}  {'tok/s/user':>10}  {'TTFT p50':>9}  {'TTFT p99':>9}  "
        f"{'ITL p50':>8}  {'acceptance':>10}  {'errors':>6}" + ("  1st/this" if len(names) > 1 else "")
    )
    rows = [head, "-" * len(head)]
    for i, first in enumerate(levels[names[0]]):
        for name in names:
            lv = levels[name][i]
            steady = lv["steady_tokens_per_s"] or lv["total_tokens_per_s"]
            base = first["steady_tokens_per_s"] or first["total_tokens_per_s"]
            ratio = f"{base / steady:>7.2f}x" if name != names[0] and steady else ""
            accept = f"{lv['acceptance_length_median']:.2f}" if lv["acceptance_length_median"] else "-"
            rows.append(
                f"{lv['concurrency']:>5}  {name:<{width}}  {steady:>7.1f}  {lv['tokens_per_s_per_user']:>10.1f}  "
                f"{lv['ttft_p50_s']:>7.3f} s  {lv['ttft_p99_s']:>7.3f} s  {lv['itl_p50_s'] * 1000:>5.0f} ms  "
                f"{accept:>10}  {len(lv['errors']):>6}" + (f"  {ratio}" if len(names) > 1 else "").rstrip()
            )
    errors = [e for lvs in levels.values() for lv in lvs for e in lv["errors"]]
    rows += [
        "",
        "tok/s: output tokens/s while every client had a request in flight; tok/s/user: the median request's;",
        "ITL: time between streamed responses; acceptance: tokens per target forward (the median request's).",
    ]
    if errors:
        rows.append(f"{len(errors)} requests failed; the first: {errors[0]}")
    return "\n".join(rows)


def _check_pair(servers: int) -> None:
    if servers != 2:
        raise DFlashError(
            f"--gate compares a DFlash deployment with its --no-draft twin: give exactly two --url, got {servers}."
        )


# One-sided 95 % quantiles of Student's t by degrees of freedom (1..30): the bound a level's speed-up is judged by
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753)
T95 += (1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def paired_speedup(ratios: list[float]) -> tuple[float, tuple[float, float] | None]:
    """The geometric mean of the rounds' paired ratios, and the bounds it lies within with 95 % confidence each way
    (Student's t over the ratios' logarithms: rounds scatter by a share of their speed, and a ratio and its inverse
    lie equally far from 1); one round has no spread to judge by, so no bounds."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    t = T95[len(logs) - 2] if len(logs) <= len(T95) + 1 else statistics.NormalDist().inv_cdf(0.95)
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))


def _level_verdict(errors: int, low: float, high: float) -> str:
    if errors:
        return "failed requests"
    return "slower" if high < 1.0 else "faster" if low > 1.0 else "within noise"


def gate_verdict(levels: dict[str, list[dict]]) -> dict:
    """The acceptance gate: the first server (a DFlash deployment) against the second (its `--no-draft` twin), level
    by level; it fails where DFlash is measurably slower at any level or a request failed.

    Each round's ratio is DFlash's steady tokens/s over the twin's in the same round (the pair served back to back),
    so a change in the machine's speed between rounds does not count. A level's speed-up is the rounds' geometric
    mean; with two rounds or more DFlash loses where even the upper 95 % bound is below 1, and a level whose bounds
    hold 1 is "within noise": a DFlash build that decodes plainly there runs the draft-free program, and the two builds
    differ round to round by what the machine does beside them (the same build against itself by 0.92-1.03x on a
    2-core VM, docs/performance.md#noise-floor). One round is judged by its ratio alone."""
    _check_pair(len(levels))
    dflash, twin = levels.values()
    rows = []
    for a, b in zip(dflash, twin):
        key = "steady_tokens_per_s" if a["steady_tokens_per_s"] and b["steady_tokens_per_s"] else "total_tokens_per_s"
        pairs = zip(a.get(f"{key}_rounds", [a[key]]), b.get(f"{key}_rounds", [b[key]]))
        ratios = [x / y for x, y in pairs if x and y]
        speedup, bounds = paired_speedup(ratios) if ratios else (0.0, None)
        low, high = bounds or (speedup, speedup)
        errors = len(a["errors"]) + len(b["errors"])
        rows.append(
            {
                "concurrency": a["concurrency"],
                "speedup": round(speedup, 3),
                "bounds": None if bounds is None else [round(low, 3), round(high, 3)],
                "rounds": len(ratios),
                "verdict": _level_verdict(errors, low, high),
                "tau": a["acceptance_length_median"],
                "errors": errors,
            }
        )
    return {"passed": all(r["verdict"] in ("faster", "within noise") for r in rows), "levels": rows}


def gate_lines(verdict: dict) -> list[str]:
    """One line per level: its speed-up, its bounds, its verdict."""

    def bounds(lv: dict) -> str:
        if lv["bounds"] is None:
            return f"{lv['rounds']} round: no bounds"
        return f"{lv['bounds'][0]:.2f}-{lv['bounds'][1]:.2f}x with 95 % confidence over {lv['rounds']} rounds"

    return [
        f"{lv['concurrency']:>5} users: {lv['speedup']:.2f}x its twin ({bounds(lv)}): {lv['verdict']}"
        for lv in verdict["levels"]
    ]


def gate_failure(verdict: dict) -> str | None:
    """The gate's failure as one sentence, naming its worst level; None where it passed."""
    lost = [lv for lv in verdict["levels"] if lv["verdict"] in ("slower", "failed requests")]
    if not lost:
        return None
    worst = min(lost, key=lambda lv: lv["speedup"])
    if worst["errors"]:
        return f"{worst['errors']} requests failed at {worst['concurrency']} users"
    surely = f", at most {worst['bounds'][1]:.2f}x with 95 % confidence" if worst["bounds"] else ""
    return f"DFlash is {worst['speedup']:.2f}x its draft-free twin at {worst['concurrency']} users{surely}"


def _verdict(levels: dict[str, list[dict]], prompts: list[str], source: str, started: str, servers: dict) -> dict:
    """The gate's verdict with what it was judged on, as the manifest records it."""
    from trtllm_dflash.cpu import cpu_model

    return gate_verdict(levels) | {
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        "prompts": source,
        "date": started,
        "machine": cpu_model(),
        "servers": servers,
    }


def compare_builds(
    folders: dict[str, Path],
    prompts: list[str],
    concurrency: list[int],
    *,
    max_tokens: int,
    requests: int = 0,
    rounds: int = 2,
    progress=print,
) -> tuple[dict[str, list[dict]], list[str]]:
    """Two builds served at once by the real Triton server and compared level by level (`loadgen.compare_rounds`),
    per build one `summary` per level (the median round's), and which build started first in each round.

    On the 2-core VMs we measure on, a server started after another serves some percent faster, whatever it serves
    (docs/performance.md#which-server-starts-first): each build starts first for half of `rounds` (the first build
    for the odd one), the pair restarted between the halves. One round has one order, and cannot cancel it.
    """
    from trtllm_dflash.clients.loadgen import Job, compare_rounds, median_level, run_load
    from trtllm_dflash.serving.serve import ServerConfig, TritonServer

    names = list(folders)
    runs = {name: {c: [] for c in concurrency} for name in names}
    started_first: list[str] = []
    for order, n in ((names, (rounds + 1) // 2), (names[::-1], rounds // 2)):
        if not n:
            continue
        progress(f"{order[0]} started first, {n} round{'s' * (n > 1)}")
        servers = {}
        try:
            for name in order:
                config = ServerConfig(folders[name], grpc_port=0, http_port=0, metrics_port=0)
                servers[name] = TritonServer(config).start()
                run_load(servers[name].grpc_url, [Job(p, 16) for p in prompts[:2]], 2)  # warm-up
            half = compare_rounds(
                {name: servers[name].grpc_url for name in names},
                prompts,
                concurrency,
                max_tokens=max_tokens,
                requests=requests,
                rounds=n,
                progress=progress,
            )
        finally:
            for server in servers.values():
                server.stop()
        for name in names:
            for c in concurrency:
                runs[name][c] += half[name][c]
        started_first += [order[0]] * n
    levels = {name: [{"concurrency": c} | median_level(runs[name][c]) for c in concurrency] for name in names}
    return levels, started_first


def build_verified(
    opts,
    prompts_file: str,
    concurrency: list[int] | None = None,
    *,
    max_tokens: int = VERIFY_TOKENS,
    rounds: int = 2,
    progress=print,
) -> Path:
    """`trtdflash build --verify-on`: build, then, before the output is written, run the acceptance gate on the
    user's prompts: the new build and its draft-free twin (built beside it in a temporary folder) served by the real
    Triton server, at every concurrency level (default: 1, 2, 4, ... up to the build's max_batch_size), `rounds`
    rounds each (compare_builds; two already tell a clear loss from the rounds' spread, gate_verdict). A build that
    loses at any level is not written (one sentence naming the level); one that passes carries the verdict in its
    manifest.json, as `trtdflash bench --gate --deployment` records it."""
    from trtllm_dflash.deploy import read_build, run_build
    from trtllm_dflash.engine.plan import batch_sizes

    if opts.no_draft:
        raise DFlashError("--verify-on compares a DFlash build with its draft-free twin; a --no-draft build has none.")
    if opts.resolved_backend != "torch":
        raise DFlashError(
            "--verify-on serves the build with the embedded engine on this machine; for a TensorRT-LLM deployment run "
            "`trtdflash bench --gate` against it and its --no-draft twin on the GPU host."
        )
    if concurrency is not None:
        check_levels(concurrency)  # before anything is built
    prompts = read_prompts(prompts_file)

    def verify(build: Path) -> tuple[str, dict]:
        levels_at = concurrency or batch_sizes(read_build(build)["resolved"]["max_batch_size"])
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with tempfile.TemporaryDirectory() as tmp:
            twin_opts = replace(opts, output=Path(tmp) / "twin", no_draft=True, draft=None, draft_engine=False)
            twin = run_build(twin_opts, progress)
            progress(f"acceptance gate: {len(prompts)} prompts at {levels_at} users, DFlash and its twin")
            levels, _ = compare_builds(
                {"dflash": build, "twin": twin},
                prompts,
                levels_at,
                max_tokens=max_tokens,
                rounds=rounds,
                progress=progress,
            )
        verdict = _verdict(levels, prompts, prompts_file, started, {"dflash": "this build", "twin": "--no-draft"})
        progress("\n".join([table(levels), "", *gate_lines(verdict)]))
        if failure := gate_failure(verdict):
            raise DFlashError(f"--verify-on: {failure}; nothing was written to {opts.output}.")
        return "acceptance_gate", verdict

    return run_build(opts, progress, verify=verify)


def run_bench(
    urls,
    concurrency: list[int],
    *,
    prompts_file: str | None = None,
    max_tokens: int = 128,
    requests: int = 0,
    rounds: int = 1,
    output: str | None = None,
    gate: bool = False,
    deployment: str | None = None,
    interactivity: Sequence[float] = (),
    progress=print,
) -> dict:
    """Load the servers, then the report (and, with `output`, the results JSON and the plot beside it). `gate`: judge
    the first server against the second (gate_verdict), and with `deployment` (the DFlash build's folder) record the
    verdict in its manifest.json. `interactivity`: tokens/s per user at which to read each server's throughput off its
    measured curve (interactivity.readout)."""
    from trtllm_dflash.cpu import cpu_model

    servers = parse_urls(urls)
    if gate:
        _check_pair(len(servers))  # before any load is sent
    if deployment and not gate:
        raise DFlashError("--deployment records the acceptance gate's verdict: pass --gate with it.")
    if deployment:
        from trtllm_dflash.deploy.core import read_build

        read_build(Path(deployment))  # a build to record into, checked before any load is sent
    prompts = read_prompts(prompts_file) if prompts_file else default_prompts()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    levels = compare(
        servers, prompts, concurrency, max_tokens=max_tokens, requests=requests, rounds=rounds, progress=progress
    )
    report = {
        "benchmark": "trtdflash bench",
        "date": started,
        "client_cpu": cpu_model(),
        "servers": servers,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompts": prompts_file or "default: held-out GSM8K and everyday questions",
        "num_prompts": len(prompts),
        "levels": levels,
    }
    if interactivity:
        from trtllm_dflash.clients.interactivity import readout

        report["interactivity"] = readout(levels, interactivity)
    if gate:
        report["gate"] = _verdict(levels, prompts, report["prompts"], started, servers)
        if deployment:
            from trtllm_dflash.deploy.core import record_in_manifest

            record_in_manifest(Path(deployment), "acceptance_gate", report["gate"])
            progress(f"recorded the gate's verdict in {Path(deployment) / 'manifest.json'}")
    if output:
        out = Path(output)
        write_json(out, report)
        plot_pareto(
            levels,
            f"trtdflash bench, concurrency annotated\n{started[:16].replace('T', ' ')} UTC, client {report['client_cpu']}",
            out.with_suffix(".png"),
            interactivity,
        )
        progress(f"wrote {out} and {out.with_suffix('.png')}")
    extra = {"table": table(levels)}
    if interactivity:
        from trtllm_dflash.clients.interactivity import readout_lines

        extra["interactivity_lines"] = readout_lines(report["interactivity"], list(levels))
    return report | extra


def renderer(tokenizer: str | None):
    """`render(messages, **template_kwargs) -> text`: the chat template of the tokenizer in folder `tokenizer`, applied
    client-side (what a Triton gRPC client sends for a multi-turn record); None without one."""
    if not tokenizer:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda messages, **kw: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def run_dataset(
    urls,
    concurrency: list[int],
    records,
    *,
    dataset: str,
    max_tokens: int = 128,
    tokenizer: str | None = None,
    interactivity: Sequence[float] = (),
    output: str | None = None,
    progress=print,
) -> dict:
    """`bench --dataset`: the records (datasets.Record) at every concurrency level on every server, run as SPEED-Bench's
    harness runs them (loadgen.run_records), measured with its definitions (specbench: acceptance per category,
    histogram, conditional and joint acceptance; Output TPS, TTFT, generation tokens/s). A level's point on the
    interactivity curve is the harness's Output TPS against its median per-request generation tokens/s. The first
    server's speculation profile (specbench.profile), measured at the first level, goes beside `output`."""
    from trtllm_dflash.clients.interactivity import PER_USER, TOTAL, readout
    from trtllm_dflash.clients.loadgen import run_records
    from trtllm_dflash.clients.specbench import PROFILE, acceptance, profile, timing
    from trtllm_dflash.cpu import cpu_model

    servers = parse_urls(urls)
    check_levels(concurrency)
    progress = progress or (lambda message: None)
    render = renderer(tokenizer)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    levels: dict[str, list[dict]] = {name: [] for name in servers}
    first = None  # the first server's conversations at the first level: what its speculation profile is measured on
    for c in concurrency:
        for name, url in servers.items():
            convs, errors, estimated = run_records(url, records, c, max_tokens, render=render)
            first = first or convs
            if len(errors) == len(records):
                raise DFlashError(f"{name} failed every record; the first: {errors[0]}")
            t = timing(convs)
            level = {
                "concurrency": c,
                "acceptance": acceptance(convs),
                "timing": t,
                "errors": errors,
                "chunk_tokens_estimated": estimated,
                TOTAL: t.get("Output TPS"),  # the harness's window: first request sent to last response
                PER_USER: (t.get("Request Generation Tokens Per Second") or {}).get("quantiles", {}).get("0.5"),
            }
            levels[name].append(level)
            progress(
                f"c={c:<3d} {name}: Average_AL {level['acceptance']['Average_AL']:.2f}, Output TPS "
                f"{t.get('Output TPS', 0.0):.1f}, errors {len(errors)}"
            )
    report = {
        "benchmark": "trtdflash bench --dataset",
        "dataset": dataset,
        "definitions": "NVIDIA/Model-Optimizer examples/specdec_bench a2fbac7 (metrics/acceptance_rate.py, "
        "specbench.py, timing.py)",
        "date": started,
        "client_cpu": cpu_model(),
        "servers": servers,
        "max_tokens": max_tokens,
        "records": [r.question_id for r in records],
        "levels": levels,
    }
    if interactivity:
        report["interactivity"] = readout(levels, interactivity)
    name = next(iter(servers))
    conditions = {
        "server": f"{name} ({servers[name]})",
        "dataset": dataset,
        "categories": sorted({r.category for r in records}),
        "records": len(records),
        "concurrency": concurrency[0],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "date": started,
        "machine": report["client_cpu"],
        "chunk_tokens_estimated": levels[name][0]["chunk_tokens_estimated"],
    }
    report["profile"] = profile(first, conditions)
    if output:
        out = Path(output)
        write_json(out, report)
        write_json(out.parent / PROFILE, report["profile"])
        progress(f"wrote {out} and the first server's {out.parent / PROFILE}")
    return report


def category_table(report: dict) -> str:
    """Per level: each category's acceptance (Category_AL) and the overall Average_AL per server, then Output TPS."""
    names = list(report["levels"])
    lines = []
    for i, level in enumerate(report["levels"][names[0]]):
        per = [report["levels"][n][i] for n in names]
        categories = list(dict.fromkeys(c for lv in per for c in lv["acceptance"]["Category_AL"]))
        head = f"{'users ' + str(level['concurrency']):<16}" + "".join(f"{n:>14}" for n in names)
        lines += [head, "-" * len(head)]
        for cat in categories:
            cells = "".join(
                f"{lv['acceptance']['Category_AL'][cat]:>14.2f}"
                if cat in lv["acceptance"]["Category_AL"]
                else f"{'-':>14}"
                for lv in per
            )
            lines.append(f"{cat:<16}{cells}")
        lines.append(f"{'overall':<16}" + "".join(f"{lv['acceptance']['Average_AL']:>14.2f}" for lv in per))
        lines.append(f"{'Output TPS':<16}" + "".join(f"{lv['timing'].get('Output TPS', 0.0):>14.1f}" for lv in per))
        lines.append("")
    estimated = [n for n in names if any(lv["chunk_tokens_estimated"] for lv in report["levels"][n])]
    lines.append(
        "acceptance: tokens per streamed response, pooled per request, averaged over requests (SPEED-Bench's "
        "Category_AL, Average_AL); Output TPS: all output tokens from the first request sent to the last response."
        + (f" {', '.join(estimated)}: no per-chunk usage, tokens shared out by characters." if estimated else "")
    )
    return "\n".join(lines)


PROFILE_RECORDS = 22  # the built-in set's single-turn records a deployment's profile is measured on: two per category


def measure_profile(url: str, *, max_tokens: int = 128, records: int = PROFILE_RECORDS, server: str = "") -> dict:
    """The speculation profile of the server at `url` (Triton's gRPC HOST:PORT or an OpenAI http:// URL) on the
    built-in set's single-turn records, one user at a time, greedy: what `plan --calibrate` and gpu-check measure on
    the host, since a single-turn record needs no tokenizer on the client."""
    import datetime

    from trtllm_dflash.clients.datasets import builtin_records, select
    from trtllm_dflash.clients.loadgen import run_records
    from trtllm_dflash.clients.specbench import profile
    from trtllm_dflash.cpuinfo import cpu_model

    chosen = select([r for r in builtin_records() if len(r.turns) == 1], records)
    convs, errors, estimated = run_records(url, chosen, 1, max_tokens)
    if len(errors) == len(chosen):
        raise DFlashError(f"No record of the built-in set was answered; the first error: {errors[0]}")
    conditions = {
        "server": server or url,
        "dataset": "builtin, single-turn",
        "categories": sorted({r.category for r in chosen}),
        "records": len(chosen) - len(errors),
        "concurrency": 1,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_model(),
        "chunk_tokens_estimated": estimated,
    }
    return profile([c for c in convs if c.turns], conditions)
