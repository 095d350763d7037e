"""Serving under load through the real Triton server: the DFlash build vs the same build without a draft, side by side.
Backs: docs/performance.md#serving-under-load (the serving rows per CPU, e.g. the Zen 4's 1.42x / 1.36x / 1.14x at
1-4 users, within noise at 8 and 16). Reproduce: python benchmarks/bench_serving.py --dtypes bf16 --concurrency 1 2 4
8 16 --rounds 8.

Closed-loop gRPC streaming clients (each sends its next request when the previous one ends) at every concurrency
level, held-out prompts (GSM8K questions never used for training, and chat questions), per dtype. Both builds are
served at once and each level runs on one and then the other (the order alternating between rounds), so a drift in
the machine's speed falls on both, and each build starts first for half the rounds (`bench.compare_builds`: the
server started second serves faster on these VMs). Every figure is the median of `--rounds` runs, and DFlash's ratio
to the build without a draft the geometric mean of the rounds' ratios (each round's pair served back to back), with
its 95 % bounds each way and a verdict, as the acceptance gate judges: faster, slower, or within noise. Reports total
tokens/s (steady: while all clients have a request in flight; and over the whole run), tokens/s per user, time to
first token and inter-token latency (p50/p99) per level, DFlash's ratio, and a Pareto plot (tokens/s per user vs
steady total tokens/s).

    python benchmarks/bench_serving.py --dtypes fp32 bf16 --concurrency 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.clients.bench import compare_builds, gate_lines, gate_verdict
from trtllm_dflash.clients.loadgen import default_prompts, plot_pareto
from trtllm_dflash.config import SPECULATION
from trtllm_dflash.cpu import machine_info
from trtllm_dflash.deploy import BuildOptions, run_build


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 4 x concurrency))")
    ap.add_argument(
        "--rounds", type=int, default=3, help="runs of every level per build; figures are the median round's"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--math-prompts", type=int, default=16)
    ap.add_argument("--speculation", default="adaptive", choices=SPECULATION)
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="the builds' prefix cache (default off: the prompts repeat across levels and rounds, and a server "
        "would copy their chunks from the second time on, which traffic of distinct prompts does not get; "
        "the chat template's head is copied either way)",
    )
    ap.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/results/serving-<target>.json, plot beside it)"
    )
    args = ap.parse_args(argv)
    if args.requests and args.requests <= max(args.concurrency):
        ap.error(
            "--requests must exceed the highest --concurrency: the steady window starts once every client streams and ends when the queue runs dry"
        )

    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"serving-{args.target}.json"
    prompt_list = default_prompts(args.math_prompts)
    result = {
        "benchmark": "bench_serving",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "target": args.target,
        "max_tokens": args.max_tokens,
        "speculation": args.speculation,
        "prefix_cache_tokens": args.prefix_cache_tokens,
        "max_batch_size": max(args.concurrency),
        "rounds": args.rounds,
        "prompts": len(prompt_list),
        "levels": {},
        "ratios": {},
    }
    builds = (("dflash", False), ("no-draft", True))
    verdicts = {}  # dtype -> gate_verdict of DFlash against the build without a draft
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            folders = {
                name: run_build(
                    BuildOptions(
                        output=Path(tmp) / f"{dtype}-{name}",
                        target=args.target,
                        no_draft=no_draft,
                        dtype=dtype,
                        max_batch_size=max(args.concurrency),
                        max_seq_len=1024,
                        speculation=args.speculation,
                        prefix_cache_tokens=args.prefix_cache_tokens,
                    ),
                    progress=lambda m: None,
                )
                for name, no_draft in builds
            }
            levels, result["started_first"] = compare_builds(
                folders,
                prompt_list,
                args.concurrency,
                max_tokens=args.max_tokens,
                requests=args.requests,
                rounds=args.rounds,
                progress=lambda m: print(f"{dtype} {m}", flush=True),
            )
            for name, _ in builds:
                result["levels"][f"{dtype} {name}"] = levels[name]
            d, a = result["levels"][f"{dtype} dflash"], result["levels"][f"{dtype} no-draft"]
            verdicts[dtype] = gate_verdict({"d": d, "a": a})
            judged = verdicts[dtype]["levels"]
            result["ratios"][dtype] = {
                # the rounds' geometric mean, each round's pair served back to back: the acceptance gate's speed-up,
                # its 95 % bounds each way and its verdict (faster, slower, or within noise: the bounds hold 1)
                "dflash_vs_no_draft": {str(lv["concurrency"]): lv["speedup"] for lv in judged},
                "dflash_vs_no_draft_bounds": {str(lv["concurrency"]): lv["bounds"] for lv in judged},
                "verdict": {str(lv["concurrency"]): lv["verdict"] for lv in judged},
                "dflash_median_vs_no_draft_median": {  # each build's median round over the other's
                    str(x["concurrency"]): round(x["steady_tokens_per_s"] / y["steady_tokens_per_s"], 3)
                    for x, y in zip(d, a)
                },
                "dflash_vs_no_draft_whole_run": {
                    str(x["concurrency"]): round(x["total_tokens_per_s"] / y["total_tokens_per_s"], 3)
                    for x, y in zip(d, a)
                },
                "dflash_vs_no_draft_rounds": {  # each round's, the pair served back to back
                    str(x["concurrency"]): [
                        round(p / q, 3)
                        for p, q in zip(x["steady_tokens_per_s_rounds"], y["steady_tokens_per_s_rounds"])
                    ]
                    for x, y in zip(d, a)
                },
                "dflash_top_vs_c1": round(  # steady tokens/s at the highest concurrency over concurrency 1
                    d[-1]["steady_tokens_per_s"] / d[0]["steady_tokens_per_s"], 3
                ),
            }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_pareto(
        result["levels"],
        f"{result['target']} via Triton, concurrency annotated\n{result['machine']['cpu']}, {result['date'][:10]}",
        out.with_suffix(".png"),
    )
    print(json.dumps(result["ratios"], indent=2))
    for dtype, verdict in verdicts.items():
        print("\n".join([f"{dtype}, DFlash against the build without a draft:", *gate_lines(verdict)]))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
