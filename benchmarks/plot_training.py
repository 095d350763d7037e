"""Training curves of one or more consecutive train-draft runs (a run and its --init-from continuations).
Backs: trtllm_dflash/drafts/smollm2-135m/TRAINING.md#the-seven-stages (the training curves of the shipped draft,
benchmarks/results/training-smollm2-135m.png). Reproduce: python benchmarks/plot_training.py runs/smollm2-b8
runs/smollm2-b8-v2 runs/smollm2-b8-v3 runs/smollm2-b8-v4 runs/smollm2-b8-v5 runs/smollm2-b8-v6 runs/smollm2-b8-v7
--out benchmarks/results/training-smollm2-135m.png.

Reads each RUN/train_log.jsonl in order (later runs' steps are offset to follow the earlier ones) and plots
train loss and tau (smoothed), held-out tau and held-out per-position accuracy at the last evaluation.

    .venv/bin/python benchmarks/plot_training.py runs/smollm2-b8 runs/smollm2-b8-v2 runs/smollm2-b8-v3 runs/smollm2-b8-v4 runs/smollm2-b8-v5 runs/smollm2-b8-v6 runs/smollm2-b8-v7 --out benchmarks/results/training-smollm2-135m.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(run: Path) -> list[dict]:
    path = run / "train_log.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass train-draft --output directories.")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smooth(values: list[float], alpha: float = 0.02) -> list[float]:
    out, ema = [], None
    for v in values:
        ema = v if ema is None else (1 - alpha) * ema + alpha * v
        out.append(ema)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "training.png")
    a = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tau, ax_pos) = plt.subplots(1, 3, figsize=(15, 4.2))
    offset, last_eval = 0, None
    for i, run in enumerate(a.runs):
        rows = read_log(run)
        steps = [offset + r["step"] for r in rows]
        c = plt.cm.tab10(i % 10)  # one colour per run: pale train curve, dots for its held-out evaluations
        ax_loss.plot(steps, smooth([r["loss"] for r in rows]), color=c, alpha=0.45, label=f"{run.name} (train, EMA)")
        ax_tau.plot(steps, smooth([r["tau"] for r in rows]), color=c, alpha=0.45, label=f"{run.name} train (EMA)")
        evals = [r for r in rows if "val_tau" in r]
        if evals:
            ev_steps = [offset + r["step"] for r in evals]
            ax_tau.plot(ev_steps, [r["val_tau"] for r in evals], "o-", color=c, label=f"{run.name} held-out")
            ax_loss.plot(ev_steps, [r["val_loss"] for r in evals], "o-", color=c, label=f"{run.name} held-out")
            last_eval = (run.name, evals[-1])
        if len(a.runs) > 1 and offset:
            for ax in (ax_loss, ax_tau):
                ax.axvline(offset, color="grey", lw=0.8, ls="--")
        offset = steps[-1] if steps else offset
    ax_loss.set(title="loss (weighted CE; train over a sampled vocabulary)", xlabel="step", yscale="log")
    ax_tau.set(title="simulated acceptance length tau", xlabel="step")
    if last_eval:
        name, ev = last_eval
        acc = ev["val_acc_per_position"]
        ax_pos.bar(range(1, len(acc) + 1), acc)
        ax_pos.set(title=f"held-out accuracy per block slot ({name}, step {ev['step']})", xlabel="slot", ylim=(0, 1))
    for ax in (ax_loss, ax_tau):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
