"""How much the target's decode step depends on where in memory its weights lie: the same packed weights copied to
several places in one process, the step timed with each copy in turn.

On a shared VM, memory at some addresses streams slower than at others, and the difference holds for as long as the
process keeps it (the host's backing of the guest's pages, which the guest cannot see). An engine's speed then depends
on where its weights landed. Two engines loaded one after the other in a process, or two servers, differ by that much
with nothing else different, and one timed against the other carries it. Each round swaps every copy in once, the
order rotating, so a machine that drifts slows every copy alike; the spread between the copies' medians is the floor
under any A/B of two loaded engines on the machine.

    python benchmarks/bench_placement.py --copies 6 --rounds 30
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads, server_thread_env

configure_threads()
os.environ.update(server_thread_env())  # before torch loads: a served model's settings (threads.py)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--copies", type=int, default=6, help="places the weights are timed at: the loaded ones and copies")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--steps", type=int, default=5, help="decode steps per copy and round (their median is the round's)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "placement.json"))
    args = ap.parse_args(argv)
    if args.copies < 2 or args.rounds < 1 or args.steps < 1:
        raise SystemExit("--copies must be at least 2, --rounds and --steps at least 1.")

    import torch
    from bench_engines import cpu_ticks

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.kernels.packed import PackedLinear

    engine = DFlashEngine.load(args.target, no_draft=True, dtype=args.dtype, progress=lambda m: None)
    target = engine.target
    linears = [m for m in target.model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
    if not linears:
        raise SystemExit(f"{args.target} in {engine.dtype} keeps no packed weights here: nothing to place.")
    places = [[m.packed for m in linears]] + [[m.packed.clone() for m in linears] for _ in range(args.copies - 1)]
    megabytes = sum(p.numel() * p.element_size() for p in places[0]) / 2**20
    cache = target.new_cache(1, 256)
    ids = torch.randint(100, 1000, (1, 129), generator=torch.Generator().manual_seed(0))
    times: list[list[float]] = [[] for _ in places]
    ticks = cpu_ticks()
    with torch.inference_mode():
        target.forward(ids[:, :128], 0, cache, capture=False, logits_to_keep=1)
        for r in range(args.rounds + 1):  # round 0 warms up
            for c in list(range(len(places)))[r % len(places) :] + list(range(len(places)))[: r % len(places)]:
                for m, p in zip(linears, places[c]):
                    m.packed = p
                target.rebind()  # the layers' calls hold their weights (a step's layer is one kernel call)
                steps = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    target.forward(ids[:, 128:], 128, cache, capture=False)  # the same position each time
                    steps.append(time.perf_counter() - t0)
                if r:
                    times[c].append(statistics.median(steps))
    ticks = [b - a for a, b in zip(ticks, cpu_ticks())]
    medians = [statistics.median(t) * 1000 for t in times]
    copies = [
        {
            "copy": c,
            "address": hex(places[c][0].data_ptr()),
            "ms": round(m, 3),
            "q1_ms": round(statistics.quantiles(times[c], n=4)[0] * 1000, 3),
        }
        for c, m in enumerate(medians)
    ]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "torch_threads": torch.get_num_threads(),
        "dtype": engine.dtype,
        "args": vars(args),
        "weights_mb": round(megabytes, 1),
        "steal_share": round(ticks[7] / max(sum(ticks), 1), 4),
        "slowest_over_fastest": round(max(medians) / min(medians), 3),
        "copies": copies,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for c in copies:
        print(
            f"copy {c['copy']} at {c['address']}: {c['ms']:.2f} ms a decode step"
            + (" (as loaded)" if c["copy"] == 0 else "")
        )
    print(
        f"{megabytes:.0f} MB of packed weights, {engine.dtype}; slowest copy / fastest: {report['slowest_over_fastest']:.3f}, "
        f"steal {100 * report['steal_share']:.1f} %",
        file=sys.stderr,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
