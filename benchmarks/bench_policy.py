"""What the speculation policy does with each of the quickstart's prompts at batch 1, in-process, with the threads a
served model gets (`server_thread_env`: steps on one CPU fewer than the machine has, prompts prefilled on all).

Every configuration runs on an engine loop of its own (`DFlashEngine.scheduler`, as the Triton model runs it), so a
loop's policy learns only from the requests it serves:

- alone: each prompt on three loops, the adaptive policy (the default), a full block every step
  (`--speculation fixed`; prompt lookup on in both, as `generate` runs them: a lookup row verifies up to 32 tokens
  instead of the draft's block) and the build without a draft, the order alternating between rounds; the engines are
  loaded anew for each prompt, the load order rotating, as where an engine's weights land in memory moves its speed
  by several percent (`bench_placement.py`);
- sequence: the quickstart's order (its streamed prompt, an 8-token warm-up, then rounds of chat, math and code)
  on one adaptive loop and one draft-free loop, taking turns per request. A new request is priced with all requests'
  acceptance until its own counts outweigh it (policy.py), so what a prompt gets depends on what ran before it:
  the JSON records each request's drafted and accepted tokens and its block lengths.

    python benchmarks/bench_policy.py --rounds 5 --max-new-tokens 96
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

from trtllm_dflash.threads import configure_threads, server_thread_env

configure_threads()
os.environ.update(server_thread_env())  # before torch loads: a served model's settings (threads.py)


def run(engine, scheduler, prompt: str, max_new_tokens: int) -> dict:
    from trtllm_dflash.engine.request import GenerationStats

    stats, tokens = GenerationStats(), 0
    t0 = time.perf_counter()
    for ids, _ in engine.stream(engine.encode(prompt), max_new_tokens=max_new_tokens, stats=stats, scheduler=scheduler):
        tokens += len(ids)
    seconds = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 2),
        "acceptance_length": round(stats.acceptance_length, 3),
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "block_lengths": {str(k): v for k, v in sorted(stats.block_lengths.items())},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "policy-smollm2-135m.json"))
    args = ap.parse_args(argv)

    import torch

    from trtllm_dflash.clients.quickstart import demo_prompts, streamed_prompt
    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.runtime import DFlashEngine

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say("loading the target, the draft and the draft-free build...")
    counts: dict[str, int] = {}
    prompts = []  # (label, text): "chat 1", "math 1", "code 1", "chat 2", ...
    for kind, text in demo_prompts():
        counts[kind] = counts.get(kind, 0) + 1
        prompts.append((f"{kind} {counts[kind]}", text))
    configs = {"adaptive": {}, "fixed": {"speculation": "fixed"}, "no draft": {"no_draft": True}}

    def loops(names: list[str]):
        """Fresh engines, loaded in the order given (a policy lives with its engine and learns from every request it
        serves), with a loop each."""
        engines = {
            name: DFlashEngine.load(args.target, dtype=args.dtype, progress=lambda m: None, **configs[name])
            for name in names
        }
        return engines, {name: e.scheduler(1, e.target.max_positions) for name, e in engines.items()}

    alone = {}
    for j, (kind, prompt) in enumerate(prompts):
        order = list(configs)[j % len(configs) :] + list(configs)[: j % len(configs)]
        engines, schedulers = loops(order)
        try:
            for name, s in schedulers.items():  # one-off setup of each loop, not timed
                run(engines[name], s, "Say hello.", 8)
            runs = {name: [] for name in configs}
            for r in range(args.rounds):
                for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
                    runs[name].append(run(engines[name], schedulers[name], prompt, args.max_new_tokens))
        finally:
            for s in schedulers.values():
                s.stop()
        base = statistics.median(x["tokens_per_second"] for x in runs["no draft"])
        alone[kind] = {
            "speedup_median": {
                name: round(statistics.median(x["tokens_per_second"] for x in rs) / base, 3)
                for name, rs in runs.items()
            },
            "speedup_by_round": {
                name: [round(x["tokens_per_second"] / b["tokens_per_second"], 3) for x, b in zip(rs, runs["no draft"])]
                for name, rs in runs.items()
                if name != "no draft"
            },
            "load_order": order,
            "runs": runs,
        }
        say(f"alone, {kind}: " + ", ".join(f"{n} {v:.2f}x" for n, v in alone[kind]["speedup_median"].items()))

    engines, schedulers = loops(["adaptive", "no draft"])
    sequence = []
    try:
        for i, (label, prompt, n) in enumerate(
            [("streamed", streamed_prompt(), args.max_new_tokens), ("warm-up", prompts[0][1], 8)]
            + [(kind, p, args.max_new_tokens) for r in range(args.rounds) for kind, p in prompts]
        ):
            pair = {}
            for name in ("adaptive", "no draft") if i % 2 == 0 else ("no draft", "adaptive"):
                pair[name] = run(engines[name], schedulers[name], prompt, n)
            d, b = pair["adaptive"], pair["no draft"]
            sequence.append(
                {
                    "request": label,
                    "speedup": round(d["tokens_per_second"] / b["tokens_per_second"], 3),
                    "dflash": d,
                    "no_draft_tokens_per_second": b["tokens_per_second"],
                }
            )
            say(
                f"sequence, {label}: {sequence[-1]['speedup']:.2f}x, acceptance {d['acceptance_length']:.2f}, drafted {d['drafted_tokens']}, "
                f"blocks {d['block_lengths']}"
            )
    finally:
        for s in schedulers.values():
            s.stop()
    in_sequence = {
        kind: round(statistics.median(x["speedup"] for x in sequence if x["request"] == kind), 3) for kind, _ in prompts
    }
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "torch_threads": torch.get_num_threads(),
        "dtype": engines["adaptive"].dtype,
        "args": vars(args),
        "alone": alone,
        "sequence_speedup_median": in_sequence,
        "sequence": sequence,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{'prompt':<7} {'alone: adaptive':>16} {'fixed':>12} {'in the sequence':>16}   (speed-up over the draft-free loop)"
    )
    for kind, _ in prompts:
        m = alone[kind]["speedup_median"]
        print(f"{kind:<7} {m['adaptive']:>15.2f}x {m['fixed']:>11.2f}x {in_sequence[kind]:>15.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
