"""Multi-turn chat with and without the prefix cache: time to first token per turn of conversations resent whole
each turn (the OpenAI API's way), through the engine loop a server runs (`DFlashEngine.scheduler`, in-process).
Backs: docs/performance.md#multi-turn-chat-the-prefix-cache (time to first token at turn 6: 210 against 810 ms,
3.85x). Reproduce: python benchmarks/bench_prefix_cache.py --conversations 4 --turns 6 --max-new-tokens 96.

Each conversation asks `--turns` of the packaged magpie questions that `train-draft` holds out, one after another,
every turn's prompt the whole conversation so far rendered with the chat template (as the OpenAI front end sends it).
Two engine loops over one engine (the same models and calibration) serve the conversations in turn, one with the
default prefix-cache budget and one with none (the chat template's head is copied in both), the order alternating
between conversations. Both write the same text (a chunk's K/V has the same bits copied or computed); the JSON
records whether they did.

    python benchmarks/bench_prefix_cache.py --conversations 4 --turns 5 --max-new-tokens 96
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

from trtllm_dflash.threads import configure_threads

configure_threads()  # before torch loads: the CLI's thread settings (threads.py)


def questions(n: int) -> list[str]:
    """Held-out magpie questions (train-draft's validation share), in file order."""
    from trtllm_dflash.data import magpie_records
    from trtllm_dflash.train.trainer import TrainArgs, held_out

    return [r["question"] for r in magpie_records() if held_out(r["key"], TrainArgs.val_fraction)][:n]


def converse(conversation, asks: list[str], max_new_tokens: int) -> list[dict]:
    """One conversation from its start (`trtllm_dflash.clients.chat.Conversation`, as `trtdflash chat` runs it)."""
    from trtllm_dflash.engine.request import GenerationStats

    conversation.reset()
    turns = []
    for ask in asks:
        stats, t0 = GenerationStats(), time.perf_counter()
        text = "".join(conversation.ask(ask, max_new_tokens=max_new_tokens, stats=stats))
        turns.append(
            {
                "prompt_tokens": stats.prompt_tokens,
                "cached_tokens": stats.cached_tokens,
                "ttft_s": round(stats.time_to_first_token, 4),
                "seconds": round(time.perf_counter() - t0, 4),
                "text": text,
            }
        )
    return turns


def plot(report: dict, path: Path) -> None:
    """Median time to first token per turn, with and without the cache, over the prompt's length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_turn"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, style in (("no cache", "o--"), ("cache", "o-")):
        ax.plot(
            [r["prompt_tokens_median"] for r in rows], [r[f"{name}: ttft_ms_median"] for r in rows], style, label=name
        )
    for r in rows:
        ax.annotate(
            f"turn {r['turn']}",
            (r["prompt_tokens_median"], r["no cache: ttft_ms_median"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(-10, 6),
        )
    m = report["machine"]
    ax.set(
        xlabel="prompt tokens (the conversation so far)",
        ylabel="time to first token, ms (median)",
        title=f"Prefix cache, {report['dtype']}, {m.get('cpu', '')[:40]}, {report['date'][:16]}",
    )
    ax.title.set_fontsize(9)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefix-cache.json"))
    args = ap.parse_args(argv)

    import torch

    from trtllm_dflash.clients.chat import Conversation
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.prefix_cache import DEFAULT_TOKENS
    from trtllm_dflash.engine.runtime import DFlashEngine

    engine = DFlashEngine.load(args.target, dtype=args.dtype, progress=lambda m: print(m, file=sys.stderr))
    budgets = {"cache": DEFAULT_TOKENS, "no cache": 0}
    loops = {name: Conversation(engine, prefix_cache_tokens=b) for name, b in budgets.items()}
    asks = questions(args.conversations * args.turns)
    runs = {name: [] for name in budgets}
    try:
        for c in loops.values():  # one-off setup of each loop, not timed
            converse(c, ["Say hello."], 8)
        for c in range(args.conversations):
            order = list(budgets) if c % 2 == 0 else list(budgets)[::-1]
            for name in order:
                runs[name].append(
                    converse(loops[name], asks[c * args.turns : (c + 1) * args.turns], args.max_new_tokens)
                )
                print(
                    f"conversation {c + 1} ({name}): TTFT "
                    + ", ".join(f"{t['ttft_s'] * 1000:.0f}" for t in runs[name][-1])
                    + " ms",
                    file=sys.stderr,
                )
    finally:
        for c in loops.values():
            c.close()
    per_turn = []
    for t in range(args.turns):
        row = {"turn": t + 1, "prompt_tokens_median": statistics.median(r[t]["prompt_tokens"] for r in runs["cache"])}
        for name in budgets:
            row[f"{name}: ttft_ms_median"] = round(statistics.median(r[t]["ttft_s"] for r in runs[name]) * 1000, 1)
            row[f"{name}: cached_tokens_median"] = statistics.median(r[t]["cached_tokens"] for r in runs[name])
        row["ttft_ratio"] = round(row["no cache: ttft_ms_median"] / row["cache: ttft_ms_median"], 2)
        per_turn.append(row)
    same = all(a["text"] == b["text"] for ca, cb in zip(runs["cache"], runs["no cache"]) for a, b in zip(ca, cb))
    total = {name: round(sum(t["seconds"] for r in runs[name] for t in r), 2) for name in budgets}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "torch_threads": torch.get_num_threads(),
        "dtype": engine.dtype,
        "args": vars(args),
        "prefix_cache_tokens": DEFAULT_TOKENS,
        "per_turn": per_turn,
        "seconds_all_turns": total,
        "same_text": same,
        "runs": {
            name: [[{k: v for k, v in t.items() if k != "text"} for t in r] for r in rs] for name, rs in runs.items()
        },
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(args.out).with_suffix(".png"))
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT cache':>11} {'TTFT none':>10} {'ratio':>6}")
    for row in per_turn:
        print(
            f"{row['turn']:>4} {row['prompt_tokens_median']:>7.0f} {row['cache: cached_tokens_median']:>7.0f} "
            f"{row['cache: ttft_ms_median']:>9.1f}ms {row['no cache: ttft_ms_median']:>8.1f}ms {row['ttft_ratio']:>5.2f}x"
        )
    print(
        f"all turns: {total['cache']} s with the cache, {total['no cache']} s without; same text: {same}; wrote {args.out} and .png"
    )


if __name__ == "__main__":
    main()
