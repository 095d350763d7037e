"""What a DFlash build costs where it drafts nothing: its plain steps against the draft-free build's, on one set of weights.

At a batch size where the draft length planned by batch size (engine/plan.py) is 0, the DFlash engine decodes every
row plainly, as the build without a draft does, and should cost what it costs. Two servers cannot show whether it
does: where each process's weights land moves a step by several percent (docs/performance.md#which-server-starts-first),
and `bench_serving.py` resolves a few percent at best. Here one process loads the target once; a batch with the
draft (the adaptive policy, its plan measured at start-up as a server measures it) and a batch without it hold the
same prompts, and their steps take turns, so that the two differ only by what the engine does for the draft. The
figure per batch size is each batch's median step and their ratio, on the threads a server's steps run on (one fewer
than the CPUs: threads.server_thread_env).

    python benchmarks/bench_plain_steps.py --rows 8 16 --steps 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads, server_thread_env

configure_threads()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16], help="batch sizes (each planned to draft nothing)")
    ap.add_argument("--steps", type=int, default=200, help="steps of each batch per batch size, taking turns")
    ap.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/plain-steps-<target>.json)")
    args = ap.parse_args(argv)

    import torch

    from trtllm_dflash.clients.loadgen import default_prompts
    from trtllm_dflash.config import SamplingParams
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.batch import Batch
    from trtllm_dflash.engine.policy import BlockPolicy
    from trtllm_dflash.engine.request import Request
    from trtllm_dflash.engine.runtime import DFlashEngine

    torch.set_num_threads(int(server_thread_env()["OMP_NUM_THREADS"]))
    engine = DFlashEngine.load(args.target, dtype=args.dtype, progress=lambda *a: None)
    prompts = [engine.encode(p) for p in default_prompts(16)]
    result = {
        "benchmark": "bench_plain_steps",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "target": args.target,
        "dtype": engine.dtype,
        "steps": args.steps,
        "levels": [],
    }
    print(f"{'rows':>4}  {'planned K':>9}  {'DFlash ms':>9}  {'no draft ms':>11}  {'DFlash / no draft':>17}")
    for rows in args.rows:
        dflash = Batch(
            engine.target, engine.draft, engine.block_size, slots=rows, policy=engine.policy, prefix=engine.prefix
        )
        engine.calibrate(dflash)
        plain = Batch(engine.target, None, 1, slots=rows, policy=BlockPolicy(1), lookup=False, prefix=engine.prefix)
        budget = args.steps + 1  # no row finishes: both batches step the same rows at the same positions throughout
        for batch in (dflash, plain):
            for i in range(rows):
                req = Request(prompts[i % len(prompts)], budget, SamplingParams(), frozenset())
                while not batch.add(req):
                    pass
        seconds = {dflash: [], plain: []}
        for i in range(args.steps):
            for batch in (dflash, plain) if i % 2 else (plain, dflash):
                t0 = time.perf_counter()
                batch.step()
                seconds[batch].append(time.perf_counter() - t0)
        k = engine.policy.schedule.length_at(rows) if engine.policy.schedule else None
        ms = {name: statistics.median(seconds[b]) * 1e3 for name, b in (("dflash", dflash), ("no_draft", plain))}
        level = {"rows": rows, "planned_draft_len": k} | {f"{n}_step_ms": round(v, 3) for n, v in ms.items()}
        level["ratio"] = round(ms["dflash"] / ms["no_draft"], 4)
        result["levels"].append(level)
        print(f"{rows:>4}  {k!s:>9}  {ms['dflash']:>9.2f}  {ms['no_draft']:>11.2f}  {level['ratio']:>16.4f}x")
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"plain-steps-{args.target}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
