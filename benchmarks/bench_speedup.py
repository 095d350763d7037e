"""DFlash against plain decoding at batch 1, each in its fastest dtype, per prompt set and per CPU instruction set.
Backs: docs/performance.md#xeon-amx (batch 1 on the AMX Xeon: MT-Bench 1.70-2.03x, GSM8K 2.08-2.50x; the other CPUs'
batch-1 rows beside it). Reproduce: python benchmarks/bench_speedup.py --isa native avx2 --math 6 --chat 6
--max-new-tokens 96 --no-cli.

The figure a user on a given CPU gets: the best dtype of DFlash over the best dtype of autoregressive decoding
(bf16 decodes fastest almost everywhere; which dtype DFlash verifies fastest in depends on the CPU), on held-out
GSM8K questions and on unseen chat (MT-Bench first turns), timed two ways in one run:

- warm: one engine per dtype in this process (the engine a server runs; the CLI's thread settings), the first request
  excluded, DFlash, DFlash without prompt lookup (`draft-only`: the draft's guesses alone, lookup.py) and plain
  decoding taking turns per prompt. The draft-only ablation runs in an engine of its own: an engine's policy learns
  from every request it serves, and the lookup-free ones accept less, which shortened the DFlash runs' blocks when
  they shared one (2026-11-26 08:03: warm GSM8K tau 2.84 against 3.02 through the CLI; 2.97 in an engine serving
  DFlash alone, informal);
- cli: one `trtdflash generate --json` process per prompt and configuration, as a user types it; its own tokens/s
  (prefill and the first request's one-off setup included; loading the models and calibrating the policy not: the
  whole command's seconds are recorded beside it).

`--isa avx2` repeats everything in a child process with oneDNN and ATen limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2,
ATEN_CPU_CAPABILITY=avx2): an approximation of an AVX2-only CPU on a newer one; `--isa avx512` holds oneDNN and our
kernel off AMX's tiles (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), as a CPU with AVX-512 BF16 and no AMX (an AMD Zen 4)
runs, on a CPU with AMX.

    .venv/bin/python benchmarks/bench_speedup.py --isa native avx2 --math 3 --chat 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads

configure_threads()  # before torch loads: the warm engine gets the threads `trtdflash generate` runs with (threads.py)

from bench_step_cost import ISA_ENV, runnable_isas  # noqa: E402  (native, avx512 held off AMX, avx2)

TRTDFLASH = str(Path(sys.executable).parent / "trtdflash")


def prompt_sets(n_math: int, n_chat: int) -> dict[str, list[str]]:
    """The last n_math held-out GSM8K questions (as bench_reference) and the first n_chat MT-Bench
    first turns (categories in turn, as bench_acceptance)."""
    from bench_acceptance import mt_bench_first_turns

    from trtllm_dflash.data import gsm8k_records

    held_out = gsm8k_records(holdout=True)
    sets = {"math": [r["question"] for r in held_out[len(held_out) - n_math :]]}
    if n_chat:
        sets["chat"] = [q for _, q in mt_bench_first_turns()[:n_chat]]
    return sets


def measure_warm(args, sets) -> list[dict]:
    from trtllm_dflash.engine.request import GenerationStats
    from trtllm_dflash.engine.runtime import DFlashEngine

    rows = []
    for dtype in args.dtypes:
        engine = DFlashEngine.load(args.target, dtype=dtype, progress=lambda m: None)
        draft_only = DFlashEngine.load(args.target, dtype=dtype, lookup=False, progress=lambda m: None)
        engines = {"dflash": engine, "draft-only": draft_only, "ar": engine}  # plain decoding: block length 1 (below)
        for e in (engine, draft_only):
            e.generate(next(iter(sets.values()))[0], max_new_tokens=8)  # one-off setup, not timed
        for name, prompts in sets.items():
            runs = {"dflash": [], "draft-only": [], "ar": []}
            for i, prompt in enumerate(prompts):
                ids = engine.encode(prompt)
                for mode in list(runs)[i % 3 :] + list(runs)[: i % 3]:  # each mode first in turn
                    stats = GenerationStats()
                    for _ in engines[mode].stream(
                        ids, max_new_tokens=args.max_new_tokens, block_size=1 if mode == "ar" else None, stats=stats
                    ):
                        pass
                    runs[mode].append(stats.to_dict())
            rows += [_row("warm", name, dtype, mode, r) for mode, r in runs.items()]
        del engine, draft_only, engines
    return rows


def measure_cli(args, sets) -> list[dict]:
    rows = []
    for dtype in args.dtypes:
        for name, prompts in sets.items():
            runs = {"dflash": [], "ar": []}
            for i, prompt in enumerate(prompts):
                for mode in ("dflash", "ar") if i % 2 == 0 else ("ar", "dflash"):
                    cmd = [
                        TRTDFLASH,
                        "generate",
                        "--target",
                        args.target,
                        "--dtype",
                        dtype,
                        "--json",
                        "--prompt",
                        prompt,
                        "--max-new-tokens",
                        str(args.max_new_tokens),
                    ] + (["--no-draft"] if mode == "ar" else [])
                    t0 = time.perf_counter()
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    runs[mode].append(
                        json.loads(done.stdout.splitlines()[-1]) | {"process_seconds": time.perf_counter() - t0}
                    )
            rows += [_row("cli", name, dtype, mode, r) for mode, r in runs.items()]
    return rows


def _row(timing: str, prompts: str, dtype: str, mode: str, runs: list[dict]) -> dict:
    return {
        "timing": timing,
        "prompts": prompts,
        "dtype": dtype,
        "mode": mode,
        "median_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
        "median_acceptance_length": statistics.median(r["acceptance_length"] for r in runs),
        "tokens_per_second": [r["tokens_per_second"] for r in runs],
        "acceptance_length": [r["acceptance_length"] for r in runs],
        **({"process_seconds": [round(r["process_seconds"], 2) for r in runs]} if "process_seconds" in runs[0] else {}),
    }


def speedups(rows: list[dict]) -> list[dict]:
    """Per (timing, prompt set): the fastest DFlash dtype over the fastest plain-decoding dtype (and the same for
    DFlash without lookup, where it was timed)."""
    out = []
    for key in sorted({(r["timing"], r["prompts"]) for r in rows}):
        group = [r for r in rows if (r["timing"], r["prompts"]) == key]
        best = {
            m: max((r for r in group if r["mode"] == m), key=lambda r: r["median_tokens_per_second"])
            for m in ("dflash", "draft-only", "ar")
            if any(r["mode"] == m for r in group)
        }
        out.append(
            {
                "timing": key[0],
                "prompts": key[1],
                "dflash_dtype": best["dflash"]["dtype"],
                "ar_dtype": best["ar"]["dtype"],
                "dflash_tokens_per_second": best["dflash"]["median_tokens_per_second"],
                "ar_tokens_per_second": best["ar"]["median_tokens_per_second"],
                "acceptance_length": best["dflash"]["median_acceptance_length"],
                "speedup": best["dflash"]["median_tokens_per_second"] / best["ar"]["median_tokens_per_second"],
            }
            | (
                {
                    "draft_only_dtype": best["draft-only"]["dtype"],
                    "draft_only_speedup": best["draft-only"]["median_tokens_per_second"]
                    / best["ar"]["median_tokens_per_second"],
                    "draft_only_acceptance_length": best["draft-only"]["median_acceptance_length"],
                }
                if "draft-only" in best
                else {}
            )
        )
    return out


def child(args) -> dict:
    import torch

    from trtllm_dflash.cpu import machine_info

    sets = prompt_sets(args.math, args.chat)
    rows = measure_warm(args, sets) + (measure_cli(args, sets) if args.cli else [])
    return {
        "machine": machine_info(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "rows": rows,
        "speedups": speedups(rows),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=list(ISA_ENV))
    ap.add_argument("--math", type=int, default=3, help="held-out GSM8K questions")
    ap.add_argument("--chat", type=int, default=3, help="MT-Bench first turns (needs the bench extra; 0 = none)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--cli", action=argparse.BooleanOptionalAction, default=True, help="also time `trtdflash generate` processes"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "speedup.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # measure in this process, print JSON
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    report = {
        "benchmark": "bench_speedup",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": args.target,
        "max_new_tokens": args.max_new_tokens,
        "batch": 1,
        "greedy": True,
        "isa": {},
    }
    flags = [
        "--target",
        args.target,
        "--dtypes",
        *args.dtypes,
        "--math",
        str(args.math),
        "--chat",
        str(args.chat),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--cli" if args.cli else "--no-cli",
    ]
    for isa in runnable_isas(args.isa):
        print(f"{isa}: measuring...", flush=True)
        done = subprocess.run(
            [sys.executable, __file__, *flags, "--child"], env=os.environ | ISA_ENV[isa], capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"{isa} run failed:\n{done.stderr[-3000:]}")
        report["isa"][isa] = json.loads(done.stdout.splitlines()[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        "\n| CPU path | timing | prompts | DFlash (dtype) tok/s | plain (dtype) tok/s | speed-up | tau | without lookup: speed-up, tau |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for isa, res in report["isa"].items():
        for s in res["speedups"]:
            print(
                f"| {isa} ({res['torch_cpu_capability']}) | {s['timing']} | {s['prompts']} | {s['dflash_tokens_per_second']:.1f} "
                f"({s['dflash_dtype']}) | {s['ar_tokens_per_second']:.1f} ({s['ar_dtype']}) | {s['speedup']:.2f}x | "
                f"{s['acceptance_length']:.2f} | "
                + (
                    f"{s['draft_only_speedup']:.2f}x, {s['draft_only_acceptance_length']:.2f} |"
                    if "draft_only_speedup" in s
                    else "|"
                )
            )
    m = next(iter(report["isa"].values()))["machine"]
    print(
        f"\n{m['cpu']} ({', '.join(m['isa'])}), {m['cores']} cores, torch {m['torch']}; {report['date']}; written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
