"""Side-by-side decoding speed by block length: autoregressive (block 1), DFlash with a fixed block of each length,
and DFlash as `trtdflash generate` runs it, per dtype and thread count, same prompts, same run.

The fixed rows draft and verify exactly that many slots every step, without prompt lookup (an engine loaded with
`speculation="fixed", lookup=False`), so each row is that block length alone; the `default` row is the engine as
`generate` loads it (adaptive block lengths per step, lookup). Reports medians over prompts of tokens/s and
acceptance length, and the speed-up of every configuration against the *fastest* autoregressive configuration
measured here. Blocks longer than the draft's are refused.

    python benchmarks/bench_generate.py --target smollm2-135m --blocks 2 4 8 --dtypes fp32 bf16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from trtllm_dflash.cpu import machine_info
from trtllm_dflash.data import gsm8k_records
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def load_prompts(n_math: int) -> list[str]:
    """Held-out GSM8K questions (the last 200 train records are never used for draft training) + code prompts."""
    held_out = gsm8k_records(holdout=True)
    return [r["question"] for r in held_out[len(held_out) - n_math :]] + DEFAULT_PROMPTS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="default: the target's packaged draft")
    ap.add_argument(
        "--blocks", type=int, nargs="+", default=[2, 4, 8], help="fixed DFlash block lengths (block 1 always runs)"
    )
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--math-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate.json"))
    args = ap.parse_args(argv)

    prompts = load_prompts(args.math_prompts)
    rows = []
    for dtype in args.dtypes:
        engines = {
            "fixed": DFlashEngine.load(
                args.target, args.draft, dtype=dtype, speculation="fixed", lookup=False, progress=lambda m: None
            )
        }
        if too_long := [b for b in args.blocks if b > engines["fixed"].block_size]:
            ap.error(
                f"--blocks {' '.join(map(str, too_long))}: longer than the draft's block ({engines['fixed'].block_size})"
            )
        engines["default"] = DFlashEngine.load(args.target, args.draft, dtype=dtype, progress=lambda m: None)
        encoded = [engines["fixed"].encode(p) for p in prompts]
        configs = [("fixed", 1), *(("fixed", b) for b in args.blocks if b > 1), ("default", None)]
        for engine in engines.values():
            engine.generate(prompts[0], max_new_tokens=8)  # warm-up
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, block in configs:
                tps, taus, outputs = [], [], []
                for ids in encoded:
                    stats = GenerationStats()
                    toks = [
                        t
                        for new, _ in engines[name].stream(
                            ids, max_new_tokens=args.max_new_tokens, block_size=block, stats=stats
                        )
                        for t in new
                    ]
                    tps.append(stats.tokens_per_second)
                    taus.append(stats.acceptance_length)
                    outputs.append(toks)
                label = "default" if block is None else str(block)
                row = {
                    "dtype": dtype,
                    "threads": threads,
                    "block_size": label,
                    "median_tokens_per_second": statistics.median(tps),
                    "median_acceptance_length": statistics.median(taus),
                    "tokens_per_second": tps,
                    "acceptance_length": taus,
                    "outputs": outputs,
                }
                rows.append(row)
                print(
                    f"{dtype:5s} threads={threads} block={label:>7s}: {row['median_tokens_per_second']:6.1f} tok/s (median), "
                    f"tau {row['median_acceptance_length']:.2f}",
                    flush=True,
                )
        del engines

    baselines = [r for r in rows if r["block_size"] == "1"]
    best = max(baselines, key=lambda r: r["median_tokens_per_second"]) if baselines else None
    for r in rows:
        same = [b for b in baselines if b["dtype"] == r["dtype"] and b["threads"] == r["threads"]]
        r["lossless_vs_same_dtype_block1"] = bool(same) and r["outputs"] == same[0]["outputs"]
        r["speedup_vs_fastest_baseline"] = (
            r["median_tokens_per_second"] / best["median_tokens_per_second"] if best else None
        )
    for r in rows:
        del r["outputs"]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "target": args.target,
        "draft": args.draft or "default",
        "prompts": len(prompts),
        "configs": "block 1: plain decoding; N: a fixed block of N, no lookup; default: as trtdflash generate runs",
        "max_new_tokens": args.max_new_tokens,
        "fastest_baseline": {k: best[k] for k in ("dtype", "threads")} if best else None,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print("\n| dtype | threads | block | tok/s (median) | tau (median) | speed-up vs fastest AR | greedy output = AR |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['threads']} | {r['block_size']} | {r['median_tokens_per_second']:.1f} | "
            f"{r['median_acceptance_length']:.2f} | {r['speedup_vs_fastest_baseline']:.2f}x | {r['lossless_vs_same_dtype_block1']} |"
        )
    m = report["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {report['date']}; written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
