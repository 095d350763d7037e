"""Acceptance of `bench_acceptance.py` runs as two pictures: per draft slot, and per prompt.

A mean tau hides how it is made: a chat set whose mean passes a bar may do so through a few answers that loop (lookup
then copies them 31 tokens a step) while most answers accept far less. The left panel is the share of verify steps
that accepted each slot (slots past the draft's block are lookup's, summed); the right one every prompt's own tau,
with the set's mean and median marked.

    python benchmarks/plot_acceptance.py benchmarks/results/acceptance-smollm2-135m-stage22-lookup-40-20261201.json \
        benchmarks/results/acceptance-smollm2-135m-stage22-magpie-lookup-20261201.json --out benchmarks/results/acceptance-smollm2-135m.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

NAMES = {
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
        out += [(f"{NAMES.get(name, name)} ({s['prompts']})", s) for name, s in run["sets"].items()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench_acceptance.py results (JSON)")
    ap.add_argument(
        "--draft-slots", type=int, default=7, help="slots the draft guesses (block size - 1); later ones are lookup's"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "acceptance.png")
    a = ap.parse_args()
    sets = read_sets(a.runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_slot, ax_tau) = plt.subplots(1, 2, figsize=(13, 4.4))
    k = a.draft_slots
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
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
