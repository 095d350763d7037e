"""What quantization costs DFlash: SmolLM2-135M + its packaged draft, each format on the target, the draft, or both.
Backs: docs/quantization.md#what-quantization-costs-dflash (tau, perplexity and agreement per format). Reproduce:
OMP_NUM_THREADS=1 python benchmarks/bench_quant.py --prompts 10 --max-new-tokens 64 --calib-samples 32.

Per format (none, fp8, nvfp4, mxfp4; `trtdflash convert`, ModelOpt 0.47.0, run through the embedded runtime's
emulation of TensorRT-LLM's numerics): perplexity of the target on held-out GSM8K solutions, agreement of its greedy
output with the unquantized target's (fraction of identical tokens, first divergence), and greedy DFlash acceptance
length tau on held-out math (GSM8K), code (HumanEval) and chat prompts (a full block every step, no prompt lookup, the
draft without its vocabulary or n-gram prior: the draft's own guesses against each target). Greedy DFlash is lossless,
so the tokens of the tau runs are the quantized target's own greedy output and serve for the agreement too. Writes
benchmarks/results/quant-smollm2-135m.json and .png.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_quant.py --prompts 10 --max-new-tokens 64
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

FORMATS = ("fp8", "nvfp4", "mxfp4")
CHAT = [
    "What are three tips for sleeping better?",
    "How do I boil an egg so the yolk stays soft?",
    "Suggest a name for a small bakery.",
    "Why is the sky blue?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "What should I pack for a weekend hiking trip?",
    "How can I save money on groceries?",
    "Explain what a budget is to a teenager.",
    "Give me a simple recipe for tomato soup.",
    "How do I politely decline a meeting invitation?",
    "What is a good way to start learning to play the guitar?",
    "How often should I water a cactus?",
]


def convert(model: str, quant: str, role: str, cache: Path, calib: int) -> Path:
    from trtllm_dflash.convert import ConvertOptions, convert_checkpoint

    out = cache / f"{role}-{quant}-calib{calib}"
    if not (out / "hf_quant_config.json").is_file():
        convert_checkpoint(ConvertOptions(model=model, quant=quant, output=out, role=role, calib_samples=calib))
    return out


def perplexity(target, texts: list[str]) -> float:
    import torch

    nll, n = 0.0, 0
    for text in texts:
        ids = torch.tensor([target.tokenizer(text)["input_ids"]])
        logits, _ = target.forward(ids, 0, target.new_cache(), capture=False)
        nll += float(torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum"))
        n += ids.shape[1] - 1
    return math.exp(nll / n)


def agreement(runs: list[list[int]], refs: list[list[int]]) -> dict:
    same = total = 0
    first = []
    for out, ref in zip(runs, refs):
        k = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        first.append(k if (k < len(ref) or len(out) != len(ref)) else None)
        same += sum(a == b for a, b in zip(out, ref))
        total += max(len(out), len(ref))
    diverged = [k for k in first if k is not None]
    return {
        "identical_token_fraction": round(same / max(total, 1), 4),
        "identical_outputs": first.count(None),
        "first_divergence_median": statistics.median(diverged) if diverged else None,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["runs"]
    names = [r["name"] for r in rows]
    sets = list(rows[0]["tau"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(sets)
    for j, s in enumerate(sets):
        ax.bar([i + j * width for i in range(len(rows))], [r["tau"][s] for r in rows], width, label=s)
    base = rows[0]["tau_all"]
    ax.axhline(base * 0.95, color="grey", ls="--", lw=1, label="unquantized tau - 5 %")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], names, rotation=30, ha="right")
    ax.set_ylabel("acceptance length tau (greedy)")
    ax.set_title(
        f"SmolLM2-135M + DFlash draft, block {report['block_size']}, {report['max_new_tokens']} new tokens, {report['date'][:10]}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="prompts per set (math, code, chat)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ppl-texts", type=int, default=40, help="held-out GSM8K question+solution texts for perplexity")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "trtllm_dflash" / "quant-bench"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant-smollm2-135m.json"))
    a = ap.parse_args()

    from bench_acceptance import prompt_sets

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.data import gsm8k_records
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.models.checkpoint import load_draft
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_draft, resolve_target

    load = os.getloadavg()
    cache = Path(a.cache)
    base_target, base_draft = resolve_target("smollm2-135m", lambda m: None), resolve_draft(None, "smollm2-135m")
    targets = {"none": base_target} | {f: convert("smollm2-135m", f, "target", cache, a.calib_samples) for f in FORMATS}
    drafts = {"none": base_draft} | {f: convert(str(base_draft), f, "draft", cache, a.calib_samples) for f in FORMATS}
    combos = (
        [("none", "none")] + [(f, "none") for f in FORMATS] + [("none", f) for f in FORMATS] + [(f, f) for f in FORMATS]
    )

    sets = prompt_sets(a.prompts, a.prompts) | {"chat": [(f"chat:{i}", q) for i, q in enumerate(CHAT[: a.prompts])]}
    held_out = gsm8k_records(holdout=True)
    ppl_texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in held_out[-a.ppl_texts :]]
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "load_average_at_start": [round(x, 2) for x in load],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "target": "smollm2-135m",
        "draft": "packaged default",
        "max_new_tokens": a.max_new_tokens,
        "prompts_per_set": a.prompts,
        "calib_samples": a.calib_samples,
        "decoding": "greedy",
        "numerics": "embedded runtime emulation of TensorRT-LLM (fp32 compute; MXFP4 with MXFP8 activations as on Blackwell, "
        "OVERRIDE_QUANT_ALGO=" + os.environ.get("OVERRIDE_QUANT_ALGO", "W4A8_MXFP4_MXFP8") + ")",
        "perplexity_text": f"last {a.ppl_texts} held-out GSM8K train records (question + solution)",
        "runs": [],
    }
    loaded_targets, ppl, tokens = {}, {}, {}
    for tq, dq in combos:
        if tq not in loaded_targets:
            loaded_targets.clear()  # one target in memory at a time
            loaded_targets[tq] = TargetModel.load(targets[tq])
            ppl[tq] = perplexity(loaded_targets[tq], ppl_texts)
        tm = loaded_targets[tq]
        draft = load_draft(drafts[dq])
        tm.set_taps(draft.config.target_layer_ids)
        # a full block every step, no lookup: tau is the draft's against this target, not the policy's choice of
        # block lengths (which follows each run's measured step costs) or the prompt's repeats
        engine = DFlashEngine(tm, draft, draft.config.block_size, speculation="fixed", lookup=False)
        report["block_size"] = engine.block_size
        taus, outs, decoded, steps = {}, [], 0, 0
        t0 = time.perf_counter()
        for name, prompts in sets.items():
            sd = ss = 0
            for _, prompt in prompts:
                r = engine.generate(prompt, max_new_tokens=a.max_new_tokens)
                outs.append(r.token_ids)
                sd, ss = sd + r.stats.num_tokens - 1, ss + r.stats.steps
            taus[name] = round(sd / max(ss, 1), 3)
            decoded, steps = decoded + sd, steps + ss
        tokens.setdefault(tq, outs)
        row = {
            "name": f"target {tq} / draft {dq}",
            "target_quant": tq,
            "draft_quant": dq,
            "tau": taus,
            "tau_all": round(decoded / max(steps, 1), 3),
            "target_perplexity": round(ppl[tq], 3),
            "agreement_with_unquantized_target": agreement(outs, tokens["none"]),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
    base = report["runs"][0]["tau_all"]
    for row in report["runs"]:
        row["tau_vs_unquantized"] = round(row["tau_all"] / base, 4)
        row["within_5_percent"] = row["tau_all"] >= 0.95 * base
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
