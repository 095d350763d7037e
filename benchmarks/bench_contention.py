"""Generation speed alone and beside a busy neighbour process, with torch's default OpenMP settings and with ours.

The issue: beside a second CPU-heavy process on the same 2 cores, a `trtdflash generate` that took ~10 s alone ran for
over 5 minutes (OpenMP threads spinning against each other). trtllm_dflash/threads.py sets one thread per usable CPU
and a short spin (GOMP_SPINCOUNT=3000) before torch loads. This runs the same greedy workload as `trtdflash generate`
(DFlashEngine with the packaged draft; model loading excluded) in a fresh process per measurement:

    policy "default":  torch as it comes (OpenMP threads = cores, libgomp's spinning waits)
    policy "ours":     threads.configure_threads() first, as the CLI gets it (a Triton model's loop takes one
                       thread fewer: threads.server_thread_env)
    policy "passive":  OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once; ours until 2026-11-26)
    policy "spin-N":   GOMP_SPINCOUNT=N (a waiting thread spins N times, then sleeps)
    policy "threads-N": OMP_NUM_THREADS=N (parts combine with "+": threads-1+passive)

each alone and beside a neighbour that keeps every CPU busy (a torch matmul loop with default settings, like another
test suite, or `--neighbour spin`: one pure-Python busy loop per CPU). Reported: seconds per run and the slowdown
ratio beside/alone per policy. A neighbour that takes half the CPU time should cost about 2x, not many times. Writes
benchmarks/results/contention-<YYYYMMDD-HHMM>.json (or --out) (CPU model from lscpu, date, torch version, settings,
results).

    .venv/bin/python benchmarks/bench_contention.py                       # the measurement (needs an otherwise idle machine)
    .venv/bin/python benchmarks/bench_contention.py --quick --out /tmp/c.json   # end-to-end check, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "A train travels 60 km in 45 minutes. What is its speed in km/h? Explain step by step."

WORKLOAD = """
import json, os, sys, time
policy, max_new_tokens, repeats, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
if policy == "ours":
    from trtllm_dflash.threads import configure_threads
    configure_threads()
import torch
from trtllm_dflash.engine.runtime import DFlashEngine
engine = DFlashEngine.load("smollm2-135m", dtype=dtype, progress=lambda m: None)
engine.generate("Hi", max_new_tokens=4)  # warm-up: first-call allocations and kernel selection
times, tokens = [], 0
for _ in range(repeats):
    t0 = time.perf_counter()
    result = engine.generate(sys.argv[4], max_new_tokens=max_new_tokens)
    times.append(time.perf_counter() - t0)
    tokens = len(result.token_ids)
print(json.dumps({"seconds": times, "tokens": tokens, "torch_threads": torch.get_num_threads(),
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}))
"""

NEIGHBOURS = {
    "torch": "import torch\na = torch.randn(512, 512)\nwhile True:\n    a = torch.tanh(a @ a)\n",
    "spin": "import multiprocessing as mp, os\n"
    "def spin():\n    while True:\n        pass\n"
    "ps = [mp.Process(target=spin) for _ in os.sched_getaffinity(0)]\n[p.start() for p in ps]\n[p.join() for p in ps]\n",
}


def clean_env() -> dict[str, str]:
    """This environment without OpenMP settings: each process picks its own (or torch's defaults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "GOMP_", "KMP_"))} | {
        "HF_HUB_OFFLINE": "1"
    }


def policy_env(policy: str) -> dict[str, str]:
    """The OpenMP settings a policy runs the workload with ("ours" sets its own inside the workload); parts joined by
    "+" combine, e.g. threads-1+passive."""
    env = {}
    for part in policy.split("+"):
        name, _, n = part.partition("-")
        if part in ("default", "ours"):
            continue
        if part == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif name in ("spin", "threads") and n.isdigit():
            env["GOMP_SPINCOUNT" if name == "spin" else "OMP_NUM_THREADS"] = n
        else:
            raise SystemExit(f"unknown policy {policy!r}: default, ours, passive, spin-N, threads-N, joined by +")
    return env


def run_workload(policy: str, max_new_tokens: int, repeats: int, dtype: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", WORKLOAD, policy, str(max_new_tokens), str(repeats), PROMPT, dtype],
        capture_output=True,
        text=True,
        env=clean_env() | policy_env(policy),
        timeout=3600,
    )
    if r.returncode != 0:
        raise SystemExit(f"workload ({policy}) failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(policy: str, neighbour: str | None, args) -> dict:
    proc = None
    if neighbour:
        proc = subprocess.Popen(
            [sys.executable, "-c", NEIGHBOURS[neighbour]],
            env=clean_env(),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(args.settle)  # the neighbour is at full load before the workload starts
    try:
        out = run_workload(policy, args.max_new_tokens, args.repeats, args.dtype)
    finally:
        if proc is not None:
            os.killpg(proc.pid, 9)  # its own session: the spin neighbour's children go too
            proc.wait()
    out["median_seconds"] = statistics.median(out["seconds"])
    return out


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--neighbour", choices=sorted(NEIGHBOURS), default="torch")
    ap.add_argument(
        "--policies",
        default="default,ours,passive",
        help="Comma-separated: default, ours, passive, spin-N, threads-N (parts joined by +).",
    )
    ap.add_argument("--dtype", default="auto", help="The workload's dtype (auto: the CLI's default on this CPU).")
    ap.add_argument("--settle", type=float, default=3.0, help="Seconds the neighbour runs before the workload starts.")
    ap.add_argument("--quick", action="store_true", help="8 tokens, one run, 1 s settle: checks the script end to end.")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.max_new_tokens, args.repeats, args.settle = 8, 1, 1.0

    import torch

    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "neighbour": args.neighbour,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "quick": args.quick,
        "load_average_at_start": os.getloadavg(),
        "policies": {},
    }
    if report["load_average_at_start"][0] > 0.5 * report["cpus"]:
        print(
            f"warning: load average {report['load_average_at_start'][0]:.1f} on {report['cpus']} CPUs; 'alone' is not alone, "
            "so the ratios are not meaningful",
            file=sys.stderr,
        )
    for policy in args.policies.split(","):
        alone = measure(policy, None, args)
        beside = measure(policy, args.neighbour, args)
        ratio = beside["median_seconds"] / alone["median_seconds"]
        report["policies"][policy] = {"alone": alone, "beside_neighbour": beside, "slowdown": round(ratio, 2)}
        print(
            f"{policy:>8}: alone {alone['median_seconds']:.2f} s, beside a busy {args.neighbour} neighbour "
            f"{beside['median_seconds']:.2f} s -> {ratio:.2f}x slower ({alone['torch_threads']} threads, "
            f"wait policy {alone['omp_wait_policy'] or 'libgomp default'}, spin count {alone['gomp_spincount'] or 'default'})",
            flush=True,
        )
    out = Path(args.out) if args.out else RESULTS / f"contention-{time.strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
