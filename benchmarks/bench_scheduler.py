"""What a DFlash build costs under load without a server around it: its scheduler against the draft-free one's, on one
set of weights.

`bench_serving.py` compares two servers, and a served round's ratio scatters by about ±5 % with nothing different
between them (docs/performance.md#noise-floor): each process's weights land elsewhere. `bench_plain_steps.py` takes
that away for a step alone. This takes it away for the whole loop a server runs: one process loads the target once,
and a DFlash engine and a draft-free engine over it each get their scheduler (engine/scheduler.py, a server's
`max_batch_size` slots, a server's threads: threads.server_thread_env). At every concurrency level closed-loop client
threads (each submits its next request when the previous one ends) load one scheduler and then the other, the order
alternating between rounds, with the held-out prompts `bench_serving.py` sends and its steady window (loadgen.summary:
while every client has a request in flight). Which build's scheduler is made first moves the comparison as a server's
start order does (its KV cache and buffers land at lower addresses: docs/performance.md#served-feature-log), so half
the rounds run in a process that makes the DFlash build's first and half in one that makes it second. Each level's figure is the geometric mean of the rounds' paired ratios
with its 95 % bounds and the acceptance gate's verdict (clients/bench.py), and each build's engine-thread seconds by
phase (prefill, steps) over the whole level, wall and CPU, which say where a difference comes from.

    python benchmarks/bench_scheduler.py --concurrency 1 2 4 8 16 --rounds 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads, server_thread_env

configure_threads()
os.environ.update(server_thread_env())  # before torch is imported: a server's model process runs its steps so


class PhaseClock:
    """Engine-thread seconds (wall and CPU) a batch spends in prefill (`Batch.add`) and in steps, per build."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, batch, name: str) -> None:
        phases = {"add": "prefill", "step": "step"}

        def timed(method, phase):
            def call(*args, **kwargs):
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return method(*args, **kwargs)
                finally:
                    self.seconds[f"{name}_{phase}_wall_s"] += time.perf_counter() - wall
                    self.seconds[f"{name}_{phase}_cpu_s"] += time.thread_time() - cpu

            return call

        for method, phase in phases.items():
            setattr(batch, method, timed(getattr(batch, method), phase))


def closed_loop(scheduler, prompts: list[list[int]], requests: int, concurrency: int, max_tokens: int, stop) -> dict:
    """`requests` requests over `concurrency` client threads, as loadgen.run_load sends them to a server."""
    from trtllm_dflash.clients import loadgen
    from trtllm_dflash.config import SamplingParams
    from trtllm_dflash.engine.request import Request
    from trtllm_dflash.errors import DFlashError

    def send(i: int) -> loadgen.Outcome:
        out, t0 = loadgen.Outcome(i), time.perf_counter()
        try:
            handle = scheduler.submit(Request(prompts[i % len(prompts)], max_tokens, SamplingParams(), stop))
            for tokens, stats in handle.tokens():
                out.tokens += len(tokens)
                out.arrivals.append((time.perf_counter(), out.tokens))
                out.acceptance_length = stats.acceptance_length
        except DFlashError as e:  # counted as the gate counts a failed request
            out.error = str(e)
        out.latency = time.perf_counter() - t0
        out.ttft = out.arrivals[0][0] - t0 if out.arrivals else out.latency
        return out

    return loadgen.summary(loadgen.closed_loop(send, requests, concurrency))


def measure(args) -> dict:
    """Every level's rounds in this process, the build named by `args.first` made first."""
    from trtllm_dflash.clients.loadgen import default_prompts
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.runtime import DFlashEngine

    engine = DFlashEngine.load(args.target, dtype=args.dtype, progress=lambda *a: None)
    plain = DFlashEngine(engine.target, None, engine.block_size)  # a --no-draft build over the same weights
    prompts = [engine.encode(p) for p in default_prompts(16)]
    clock, builds = PhaseClock(), {}
    order = (("dflash", engine), ("no_draft", plain))
    for name, eng in order if args.first == "dflash" else order[::-1]:
        builds[name] = eng.scheduler(
            args.max_batch_size,
            engine.target.max_positions,
            log=lambda m: None,
            prefix_cache_tokens=args.prefix_cache_tokens,
        )
        clock.wrap(builds[name].batch, name)
    schedule = engine.policy.schedule
    result = {
        "machine": machine_info(),
        "dtype": engine.dtype,
        "planned_draft_len": {b: schedule.length_at(b) for b in range(1, args.max_batch_size + 1)}
        if schedule
        else None,
        "levels": [],
    }
    try:
        for c in args.concurrency:
            requests = args.requests or max(8, 4 * c)
            for scheduler in builds.values():  # each scheduler's first requests at this level pay one-off setup
                closed_loop(scheduler, prompts, c, c, args.max_tokens, engine.eos_token_ids)
            clock.seconds.clear()
            runs = {name: [] for name in builds}
            for r in range(args.rounds):
                for name in ("dflash", "no_draft") if r % 2 == 0 else ("no_draft", "dflash"):
                    run = closed_loop(builds[name], prompts, requests, c, args.max_tokens, engine.eos_token_ids)
                    runs[name].append(run | {"concurrency": c})
            engine_thread = {k: round(v, 3) for k, v in sorted(clock.seconds.items())}
            result["levels"].append({"runs": runs, "engine_thread": engine_thread})
            print(f"{args.first} made first: {c} users, {args.rounds} rounds done", flush=True)
    finally:
        for scheduler in builds.values():
            scheduler.stop()
    return result


def in_child(args, first: str, rounds: int) -> dict:
    """`measure` in a fresh process with `first` made first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "half.json"
        argv = [sys.executable, __file__, "--first", first, "--rounds", str(rounds), "--out", str(out)]
        argv += ["--target", args.target, "--dtype", args.dtype, "--max-tokens", str(args.max_tokens)]
        argv += ["--max-batch-size", str(args.max_batch_size), "--prefix-cache-tokens", str(args.prefix_cache_tokens)]
        argv += ["--concurrency", *map(str, args.concurrency)] + (
            ["--requests", str(args.requests)] if args.requests else []
        )
        if subprocess.run(argv).returncode != 0:
            raise SystemExit(f"The measuring process with the {first} build made first failed (its error is above).")
        return json.loads(out.read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: max(8, 4 x concurrency))")
    ap.add_argument("--rounds", type=int, default=8, help="paired runs of every level, half in each creation order")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="each scheduler's prefix cache (default off, as bench_serving)",
    )
    ap.add_argument(
        "--first",
        choices=["both", "dflash", "no_draft"],
        default="both",
        help="the build whose scheduler is made first (both: half the rounds each, in two processes)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/scheduler-<target>.json)")
    args = ap.parse_args(argv)

    from trtllm_dflash.clients.bench import gate_verdict
    from trtllm_dflash.clients.loadgen import check_levels, median_level

    check_levels(args.concurrency)
    if args.requests is not None and args.requests <= max(args.concurrency):
        ap.error(
            f"--requests ({args.requests}) must exceed the highest concurrency ({max(args.concurrency)}): the steady "
            "window lasts while every client has a request in flight."
        )
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"scheduler-{args.target}.json"
    if args.first != "both":
        out.write_text(json.dumps(measure(args), indent=2) + "\n")
        return
    halves = {
        first: in_child(args, first, n)
        for first, n in (("dflash", args.rounds // 2), ("no_draft", args.rounds - args.rounds // 2))
    }
    result = {
        "benchmark": "bench_scheduler",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": halves["dflash"]["machine"],
        "target": args.target,
        "dtype": halves["dflash"]["dtype"],
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "planned_draft_len": {f"{first} made first": half["planned_draft_len"] for first, half in halves.items()},
        "levels": [],
    }
    print(f"{'users':>5}  {'DFlash tok/s':>12}  {'no draft tok/s':>14}  {'ratio':>6}  {'bounds':>11}  verdict")
    for i, c in enumerate(args.concurrency):
        parts = [half["levels"][i] for half in halves.values()]
        levels = {n: median_level([run for p in parts for run in p["runs"][n]]) for n in ("dflash", "no_draft")}
        verdict = gate_verdict({n: [lv] for n, lv in levels.items()})["levels"][0]  # as the gate judges two servers
        tps = {n: lv["steady_tokens_per_s_rounds"] for n, lv in levels.items()}
        med = {n: lv["steady_tokens_per_s"] for n, lv in levels.items()}
        seconds = {f"{first} made first": p["engine_thread"] for first, p in zip(halves, parts)}
        result["levels"].append(verdict | {"steady_tokens_per_s_rounds": tps, "engine_thread": seconds})
        low, high = verdict["bounds"] or (verdict["speedup"],) * 2
        print(
            f"{c:>5}  {med['dflash']:>12.1f}  {med['no_draft']:>14.1f}  {verdict['speedup']:>5.3f}x  "
            f"{low:.3f}-{high:.3f}  {verdict['verdict']}"
        )
        for first, s in seconds.items():
            for n in ("dflash", "no_draft"):
                print(
                    f"       {n} ({first}): prefill {s[f'{n}_prefill_wall_s']:.2f} s ({s[f'{n}_prefill_cpu_s']:.2f} s "
                    f"CPU), steps {s[f'{n}_step_wall_s']:.2f} s ({s[f'{n}_step_cpu_s']:.2f} s CPU)"
                )
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
