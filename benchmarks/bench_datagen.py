"""Data-phase throughput of train-draft: our batched greedy loop vs Hugging Face generate(), and the packed answers'
one forward per record, same prompts, same run.
Backs: docs/performance.md#packed-answers (features at 769 answer tokens/s from packed answers against 345 generated;
our loop 2.61x HF generate(), docs/training.md#data-phase). Reproduce: python benchmarks/bench_datagen.py --prompts 64
--max-new-tokens 192 --batch-sizes 64 --dtypes bf16 --threads 1.

All answer the same train-draft prompts (greedy, bf16 and fp32, batch sizes given) with the tapped features
captured; "packed" takes the packaged answers (trtllm_dflash/data/answers-smollm2) of those prompts and runs only the
forward for their features, as the data phase does. Reports response tokens/s per configuration and the ratio of
every configuration to the fastest generate() one. Writes benchmarks/results/datagen.json.

    .venv/bin/python benchmarks/bench_datagen.py --prompts 64 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from trtllm_dflash.cpu import machine_info
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import resolve_target
from trtllm_dflash.train.records import forward_features, greedy_batch
from trtllm_dflash.train.sources import known_answers, load_prompts

LAYERS = [1, 14, 27]


@torch.inference_mode()
def hf_generate(target, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int) -> int:
    """generate() with the same taps hooked (features kept, as the data phase needs them); returns answer tokens."""
    kept = []
    hooks = [
        target.layers[l].register_forward_hook(
            lambda _m, _i, out: kept.append(out[0] if isinstance(out, tuple) else out)
        )
        for l in LAYERS
    ]
    try:
        width = max(len(x) for x in prompts)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
        out = target.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
        )[:, width:].tolist()
    finally:
        for h in hooks:
            h.remove()
    return sum(next((k + 1 for k, t in enumerate(r) if t in eos), len(r)) for r in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "datagen.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for dtype in a.dtypes:
        target = TargetModel.load(
            resolve_target(a.target, progress=lambda m: None), torch.bfloat16 if dtype == "bf16" else torch.float32
        )
        engine = DFlashEngine(target, None, 1)
        keyed = load_prompts(("gsm8k", "code"))[: a.prompts]
        prompts = [engine.encode(p) for _, p in keyed]
        known = known_answers(target, ("gsm8k", "code"), keyed, a.max_new_tokens)
        packed = [(ids, known[key][: a.max_new_tokens]) for ids, (key, _) in zip(prompts, keyed) if key in known]
        pad = (
            target.tokenizer.pad_token_id
            if target.tokenizer.pad_token_id is not None
            else target.tokenizer.eos_token_id
        )
        eos = set(engine.eos_token_ids)
        runs = [(m, bs) for bs in a.batch_sizes for m in ("generate", "greedy_batch")] + [
            ("packed", 1)
        ]  # packed: one forward per record
        for method, bs in runs:
            t0, tokens = time.perf_counter(), 0
            if method == "packed":
                for ids, answer in packed:
                    forward_features(target, ids + answer, LAYERS)
                    tokens += len(answer)
            else:
                for i in range(0, len(prompts), bs):
                    chunk = prompts[i : i + bs]
                    if method == "generate":
                        tokens += hf_generate(target, chunk, a.max_new_tokens, eos, pad)
                    else:
                        tokens += sum(
                            map(
                                len,
                                greedy_batch(target, chunk, layer_ids=LAYERS, max_new_tokens=a.max_new_tokens, eos=eos)[
                                    0
                                ],
                            )
                        )
            sec = time.perf_counter() - t0
            rows.append(
                {
                    "method": method,
                    "dtype": dtype,
                    "batch_size": bs,
                    "prompts": len(packed) if method == "packed" else len(prompts),
                    "tokens": tokens,
                    "seconds": round(sec, 2),
                    "tok_per_s": round(tokens / sec, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    best = max((r for r in rows if r["method"] == "generate"), key=lambda r: r["tok_per_s"])
    for r in rows:
        r["vs_fastest_generate"] = round(r["tok_per_s"] / best["tok_per_s"], 2)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "target": a.target,
        "prompts": a.prompts,
        "max_new_tokens": a.max_new_tokens,
        "fastest_generate": best,
        "rows": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['method']:>13} {r['dtype']} bs{r['batch_size']:<3} {r['tok_per_s']:7.1f} tok/s  {r['vs_fastest_generate']:.2f}x"
        )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
