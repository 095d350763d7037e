"""How often bf16 DFlash output differs from bf16 autoregressive output, where, and whether each difference is a near-tie.
Backs: docs/performance.md#which-dtype (30 of 30 bf16 DFlash outputs identical to bf16 plain decoding wherever our
kernels run). Reproduce: python benchmarks/bench_bf16_agreement.py --prompts 10 --max-new-tokens 128.

In bf16 a verify forward over a block and a one-token decode step round differently, so where the target's two best
tokens are nearly tied the argmax can flip, and the two outputs continue differently from there. Over the held-out
sets of bench_acceptance.py (GSM8K holdout, HumanEval, MT-Bench first turns), greedy, both decodings through
DFlashEngine in bf16 (the packaged draft's full block every step, prompt lookup on as `generate` runs it, so a lookup
step verifies up to 32 tokens; and block 1): the fraction of identical outputs, the first differing position, and at
each first difference the gap between the two tokens chosen, from one forward over the common prefix (bf16 and fp32
logits), in units of bf16's resolution at that logit's magnitude (one ulp: 2^(e-7) for a value in [2^e, 2^(e+1))).
Writes benchmarks/results/bf16-agreement-<target>.json.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bf16_agreement.py --prompts 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 values around x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0**-133


def gap_at(model, ids: list[int], a: int, b: int) -> dict:
    """Logits of tokens a and b after `ids` (one forward, no cache): their gap, and it in bf16 ulps at the larger."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    top2 = logits.topk(2).indices.tolist()
    la, lb = logits[a].item(), logits[b].item()
    gap = abs(la - lb)
    return {
        "logit_a": la,
        "logit_b": lb,
        "gap": gap,
        "gap_bf16_ulps": gap / bf16_ulp(max(abs(la), abs(lb))),
        "top2_are_the_pair": set(top2) == {a, b},
        "argmax": top2[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="Draft directory (default: the target's packaged draft).")
    ap.add_argument("--prompts", type=int, default=10, help="Prompts per set (math, code, chat).")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    from bench_acceptance import prompt_sets

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target

    engine = DFlashEngine.load(a.target, a.draft, dtype="bf16", speculation="fixed", progress=lambda m: None)
    if engine.draft is None:
        raise SystemExit(f"Target {a.target} has no draft to compare; pass --draft.")
    fp32 = TargetModel.load(resolve_target(a.target, lambda m: None), torch.float32).model
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "torch": torch.__version__,
        "target": a.target,
        "draft": str(a.draft or "packaged default"),
        "block_size": engine.block_size,
        "max_new_tokens": a.max_new_tokens,
        "decoding": "greedy, bf16 target; fixed full blocks with prompt lookup",
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "draft_weights": engine.draft_weights,
        "sets": {},
    }
    all_rows = []
    for name, prompts in prompt_sets(a.prompts, a.prompts, a.prompts).items():
        rows = []
        for key, prompt in prompts:
            prompt_ids = engine.encode(prompt)
            dflash = engine.generate(prompt, max_new_tokens=a.max_new_tokens).token_ids
            ar = engine.generate(prompt, max_new_tokens=a.max_new_tokens, block_size=1).token_ids
            row = {"id": key, "identical": dflash == ar, "tokens": [len(dflash), len(ar)]}
            if dflash != ar:
                p = next((i for i, (x, y) in enumerate(zip(dflash, ar)) if x != y), min(len(dflash), len(ar)))
                row["first_difference"] = p
                if p < min(len(dflash), len(ar)):  # a token differs (not just one output ending earlier)
                    ctx = prompt_ids + ar[:p]
                    row["tokens_at_difference"] = {"dflash": dflash[p], "autoregressive": ar[p]}
                    row["bf16_forward"] = gap_at(engine.target.model, ctx, dflash[p], ar[p])
                    row["fp32_forward"] = gap_at(fp32, ctx, dflash[p], ar[p])
            rows.append(row)
            print(
                f"{name} {key}: "
                + (
                    "identical"
                    if row["identical"]
                    else f"differs at {row['first_difference']}, fp32 gap {row.get('fp32_forward', {}).get('gap_bf16_ulps', float('nan')):.2f} bf16 ulps"
                ),
                flush=True,
            )
        report["sets"][name] = summarize(rows)
        all_rows += rows
    report["all"] = summarize(all_rows)
    report["all"].pop("rows")
    out = Path(a.out or Path(__file__).parent / "results" / f"bf16-agreement-{a.target}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["all"], indent=2))
    print(f"wrote {out}")


def summarize(rows: list[dict]) -> dict:
    diffs = [r for r in rows if "tokens_at_difference" in r]
    ulps = [r["fp32_forward"]["gap_bf16_ulps"] for r in diffs]
    return {
        "prompts": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "identical_fraction": round(sum(r["identical"] for r in rows) / max(len(rows), 1), 3),
        "first_difference_positions": sorted(r["first_difference"] for r in rows if "first_difference" in r),
        "token_differences": len(diffs),
        "fp32_gap_bf16_ulps": sorted(round(u, 3) for u in ulps),
        "fp32_gap_within_1_ulp": sum(u <= 1 for u in ulps),
        "fp32_gap_within_4_ulps": sum(u <= 4 for u in ulps),
        "bf16_forward_exact_ties": sum(r["bf16_forward"]["gap"] == 0 for r in diffs),
        "pair_is_fp32_top2": sum(r["fp32_forward"]["top2_are_the_pair"] for r in diffs),
        "median_fp32_gap_bf16_ulps": round(statistics.median(ulps), 3) if ulps else None,
        "rows": rows,
    }


if __name__ == "__main__":
    main()
