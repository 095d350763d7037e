"""Our runtime against z-lab's reference DFlash implementation (`dflash_generate` from PyPI `dflash==0.1.0`), side by side.
Backs: docs/performance.md#xeon-amx (against z-lab's reference: fp32 1.42x like for like, 1.75x as shipped; bf16 2.32x
and 3.06x). Reproduce: python benchmarks/bench_reference.py --dtypes fp32 bf16 --prompts 4 --max-new-tokens 96.

Same target checkpoint, same packaged draft, same prompt token ids (held-out GSM8K questions through our chat template),
greedy, same dtype, same block size, same thread count. Our side runs two engines:

- `ours` (like for like): `DFlashEngine` with a fixed block length, without prompt lookup (lookup.py), the draft's
  vocabulary (models/draft_vocab.py) or its n-gram prior (models/draft_ngram.py), none of which the reference has, so
  both sides verify the very same guesses and the tokens per step agree: what differs is the loop's speed.
- `ours_shipped`: `DFlashEngine` as `trtdflash generate` loads it (adaptive block lengths, lookup, vocabulary, prior):
  what a user gets over the reference.

The reference side gets its own stock Hugging Face target and loads the draft into its own `DFlashDraftModel`, both
exactly as z-lab's `dflash.benchmark.load_transformers_models` does, on the CPU. Per prompt, ours run first and then
the reference (interleaved, so drift hits all three); each is warmed up once before timing and model loading is never
timed. tokens/s is generated tokens over the wall time of the whole call (prefill included) on every side; acceptance
length is ours `GenerationStats.acceptance_length` and, for the reference, z-lab's own: the mean of the per-step
`acceptance_lengths` that `dflash_generate(..., return_stats=True)` returns. Greedy token ids are compared with the
reference's; the first differing position is recorded. Near the max-new-tokens budget the two cut the last blocks
differently (ours drafts the full block and verifies only what the budget allows, the reference drafts min(block,
tokens allowed + 1) slots), so the draft sees a different number of mask slots there and tau can differ slightly even
when every token agrees; `tokens_per_step` in the JSON shows where.

The reference pins tqdm and transformers versions that conflict with this project's, so it is not in the `bench` extra;
install it without its dependencies (it only needs torch and transformers' qwen3 modules, which we have):

    pip install --no-deps dflash==0.1.0
    python benchmarks/bench_reference.py --dtypes fp32 bf16 --prompts 4 --max-new-tokens 128
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

import torch

from trtllm_dflash.cpu import machine_info
from trtllm_dflash.data import gsm8k_records
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DTYPES, DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.resolve import DRAFTS_DIR, resolve_target

INSTALL_HINT = "pip install --no-deps dflash==0.1.0"


def import_reference():
    """z-lab's module, with its one CUDA-only call (`_cuda_time`, used for return_stats timings) made CPU-safe."""
    try:
        from dflash import model as ref
    except ImportError as e:
        if e.name == "dflash":  # the package itself is missing (not something it imports)
            raise DFlashError(
                f"z-lab's reference package is not installed; install it with `{INSTALL_HINT}` "
                "(--no-deps: its pinned tqdm/transformers conflict with this project's)."
            ) from None
        raise DFlashError(
            f"dflash is installed but its model module does not import with this transformers ({e})."
        ) from None
    ref._cuda_time = time.perf_counter  # torch.cuda.synchronize() + perf_counter on CUDA; on the CPU just the clock
    return ref


def load_reference(ref, target_path: Path, draft_path: Path, dtype: torch.dtype):
    """Target and draft as z-lab's dflash.benchmark.load_transformers_models loads them (device cpu, our dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_path, attn_implementation="sdpa", dtype=dtype).to("cpu").eval()
    config = AutoConfig.from_pretrained(draft_path)
    draft_class = ref.DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) else ref.DFlashDraftModel
    draft, info = draft_class.from_pretrained(
        draft_path, attn_implementation="sdpa", dtype=dtype, output_loading_info=True
    )
    draft = draft.to("cpu").eval()
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:  # a silently re-initialised draft would make the comparison meaningless
        raise DFlashError(f"The reference DFlashDraftModel did not load {draft_path} cleanly: {bad}.")
    return target, draft, AutoTokenizer.from_pretrained(target_path)


def zlab_stop_token_ids(model, tokenizer) -> list[int]:
    """dflash.benchmark.stop_token_ids (copied: importing dflash.benchmark needs `requests`)."""
    token_ids = model.generation_config.eos_token_id or tokenizer.eos_token_id
    return [token_ids] if isinstance(token_ids, int) else list(token_ids)


def run_ours(engine: DFlashEngine, ids: list[int], max_new_tokens: int) -> dict:
    stats = GenerationStats()
    t0 = time.perf_counter()
    steps = [new for new, _ in engine.stream(ids, max_new_tokens=max_new_tokens, stats=stats)]
    wall = time.perf_counter() - t0
    toks = [t for new in steps for t in new]
    return {
        "tokens": toks,
        "wall_time": wall,
        "tokens_per_second": len(toks) / wall,
        "internal_tokens_per_second": stats.tokens_per_second,
        "acceptance_length": stats.acceptance_length,
        "steps": stats.steps,
        "tokens_per_step": [len(new) for new in steps[1:]],  # steps[0]: the prefill's token
        "finish_reason": stats.finish_reason,
    }


def run_reference(
    ref, target, draft, ids: list[int], max_new_tokens: int, block_size: int, stop_ids: list[int]
) -> dict:
    input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)
    t0 = time.perf_counter()
    out = ref.dflash_generate(
        draft,
        target=target,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        block_size=block_size,
        return_stats=True,
    )
    wall = time.perf_counter() - t0
    toks = out.output_ids[0, out.num_input_tokens :].tolist()
    acc = out.acceptance_lengths
    return {
        "tokens": toks,
        "wall_time": wall,
        "tokens_per_second": len(toks) / wall,
        "acceptance_length": statistics.mean(acc) if acc else 0.0,
        "steps": len(acc),
        "tokens_per_step": list(acc),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First position where the two token lists differ (a length difference counts at the shorter length), else None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--prompts", type=int, default=4, help="the last N held-out GSM8K questions")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None, help="default: benchmarks/results/reference-<target>-<UTC date>.json")
    args = ap.parse_args(argv)

    date = datetime.datetime.now(datetime.timezone.utc)
    out_path = (
        Path(args.out)
        if args.out
        else Path(__file__).parent / "results" / f"reference-{args.target}-{date:%Y%m%d-%H%M}.json"
    )
    try:
        return run(args, date, out_path)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args, date: datetime.datetime, out_path: Path) -> int:
    import importlib.metadata

    ref = import_reference()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # as z-lab's benchmark; everything here is greedy
    held_out = gsm8k_records(holdout=True)
    questions = [r["question"] for r in held_out[len(held_out) - args.prompts :]]
    target_path = resolve_target(args.target, lambda m: None)
    draft_path = DRAFTS_DIR / args.target

    runs = []
    for dtype in args.dtypes:
        # like for like: none of what the reference lacks (lookup, the draft's vocabulary, its n-gram prior), so both
        # sides verify the same draft's guesses (equal tau); then the engine as `trtdflash generate` loads it
        engine = DFlashEngine.load(
            args.target,
            dtype=dtype,
            block_size=args.block_size,
            speculation="fixed",
            lookup=False,
            draft_vocab=False,
            draft_ngram=False,
            progress=lambda m: None,
        )
        shipped = DFlashEngine.load(args.target, dtype=dtype, block_size=args.block_size, progress=lambda m: None)
        r_target, r_draft, r_tok = load_reference(ref, target_path, draft_path, DTYPES[dtype])
        if list(r_draft.target_layer_ids) != list(engine.draft.config.target_layer_ids):
            raise DFlashError(
                f"The two drafts tap different target layers: {r_draft.target_layer_ids} vs {engine.draft.config.target_layer_ids}."
            )
        stop_ids = zlab_stop_token_ids(r_target, r_tok)
        encoded = [engine.encode(q) for q in questions]
        warm = min(64, args.max_new_tokens)  # z-lab warms up with min(64, max_new_tokens) tokens
        run_ours(engine, encoded[0], warm)
        run_ours(shipped, encoded[0], warm)
        run_reference(ref, r_target, r_draft, encoded[0], warm, args.block_size, stop_ids)

        per_prompt = []
        for i, ids in enumerate(encoded):
            ours = run_ours(engine, ids, args.max_new_tokens)
            mine = run_ours(shipped, ids, args.max_new_tokens)
            theirs = run_reference(ref, r_target, r_draft, ids, args.max_new_tokens, args.block_size, stop_ids)
            diff = first_difference(ours["tokens"], theirs["tokens"])
            diff_shipped = first_difference(mine["tokens"], theirs["tokens"])
            row = {
                "prompt": i,
                "prompt_tokens": len(ids),
                "tokens_agree": diff is None,
                "first_difference": diff,
                "shipped_tokens_agree": diff_shipped is None,
                "ours": {k: v for k, v in ours.items() if k != "tokens"} | {"num_tokens": len(ours["tokens"])},
                "ours_shipped": {k: v for k, v in mine.items() if k != "tokens"} | {"num_tokens": len(mine["tokens"])},
                "reference": {k: v for k, v in theirs.items() if k != "tokens"} | {"num_tokens": len(theirs["tokens"])},
                "ratio_ours_over_reference": ours["tokens_per_second"] / theirs["tokens_per_second"],
                "ratio_shipped_over_reference": mine["tokens_per_second"] / theirs["tokens_per_second"],
            }
            if diff is not None:
                row["differing_tokens"] = {
                    "ours": ours["tokens"][diff : diff + 4],
                    "reference": theirs["tokens"][diff : diff + 4],
                }
            per_prompt.append(row)
            print(
                f"{dtype:5s} prompt {i}: ours {ours['tokens_per_second']:6.1f} tok/s tau {ours['acceptance_length']:.2f} | "
                f"as shipped {mine['tokens_per_second']:6.1f} tok/s tau {mine['acceptance_length']:.2f} | "
                f"reference {theirs['tokens_per_second']:6.1f} tok/s tau {theirs['acceptance_length']:.2f} | "
                f"tokens agree: {diff is None}" + ("" if diff is None else f" (first difference at {diff})"),
                flush=True,
            )

        med = {
            side: {
                "tokens_per_second": statistics.median(p[side]["tokens_per_second"] for p in per_prompt),
                "acceptance_length": statistics.median(p[side]["acceptance_length"] for p in per_prompt),
            }
            for side in ("ours", "ours_shipped", "reference")
        }
        runs.append(
            {
                "dtype": dtype,
                "threads": torch.get_num_threads(),
                "stop_token_ids": {"ours": sorted(engine.eos_token_ids), "reference": stop_ids},
                "median": med,
                "ratio_ours_over_reference": med["ours"]["tokens_per_second"] / med["reference"]["tokens_per_second"],
                "ratio_shipped_over_reference": med["ours_shipped"]["tokens_per_second"]
                / med["reference"]["tokens_per_second"],
                "median_per_prompt_ratio": statistics.median(p["ratio_ours_over_reference"] for p in per_prompt),
                # z-lab's summary figure: the mean over requests of each request's mean acceptance length
                "reference_mean_acceptance_length_zlab": statistics.mean(
                    p["reference"]["acceptance_length"] for p in per_prompt
                ),
                "all_tokens_agree": all(p["tokens_agree"] for p in per_prompt),
                "per_prompt": per_prompt,
            }
        )
        del engine, shipped, r_target, r_draft

    report = {
        "benchmark": "bench_reference",
        "date": date.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "reference": {
            "package": "dflash",
            "version": importlib.metadata.version("dflash"),
            "function": "dflash.model.dflash_generate",
        },
        "target": args.target,
        "draft": str(draft_path.name),
        "block_size": args.block_size,
        "prompts": len(questions),
        "ours": "fixed blocks; no lookup, draft vocabulary or n-gram prior (the reference's guesses)",
        "ours_shipped": "as trtdflash generate loads it: adaptive blocks, lookup, draft vocabulary, n-gram prior",
        "prompt_source": "gsm8k held-out (last N), chat template",
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "timing": "generated tokens / wall time of the whole call, prefill included, loading and warm-up excluded",
        "runs": runs,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")

    print(
        "\n| dtype | reference tok/s (tau) | ours, the same guesses: tok/s (tau), over the reference | ours as shipped: tok/s (tau), "
        "over the reference | greedy tokens agree (same guesses) |"
    )
    print("|---|---|---|---|---|")
    for r in runs:
        m = r["median"]
        diffs = [p["first_difference"] for p in r["per_prompt"] if not p["tokens_agree"]]
        agree = f"{len(r['per_prompt']) - len(diffs)}/{len(r['per_prompt'])}" + (
            f" (first differences at {diffs})" if diffs else ""
        )

        def cell(side, ratio):
            return f"{m[side]['tokens_per_second']:.1f} ({m[side]['acceptance_length']:.2f}), {ratio:.2f}x"

        print(
            f"| {r['dtype']} | {m['reference']['tokens_per_second']:.1f} ({m['reference']['acceptance_length']:.2f}) | "
            f"{cell('ours', r['ratio_ours_over_reference'])} | {cell('ours_shipped', r['ratio_shipped_over_reference'])} | {agree} |"
        )
    mi = report["machine"]
    print(
        f"\nmedians over {len(questions)} prompts, {args.max_new_tokens} new tokens, block {args.block_size}, {runs[0]['threads'] if runs else args.threads} "
        f"threads; {mi['cpu']}, torch {mi['torch']}; {report['date']}; written to {out_path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
