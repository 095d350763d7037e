"""What verification costs: the target's forward over k tokens against its one-token decode step, per dtype and per
CPU instruction set, through the runtime's own forward (static per-slot KV cache, context of 128 positions).
Backs: docs/performance.md#xeon-amx (a verify of 2 / 8 tokens against a decode step: 0.97x / 1.18x on the AMX Xeon,
the other CPUs' rows beside it). Reproduce: OMP_NUM_THREADS=1 python benchmarks/bench_step_cost.py --isa native avx512
avx2 --dtypes bf16 --linears packed --tokens 1 2 3 4 8 16 --reps 30.

DFlash's speed-up is tau over (verify + draft) / decode; on a GPU verify of a block costs about one decode step, on a
CPU it depends on the matrix kernels the CPU has. `--isa avx2` reruns in a subprocess with oneDNN and ATen limited to
AVX2 (ONEDNN_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2), an approximation of an AVX2-only CPU; `--isa avx512` on a
CPU with AMX holds oneDNN and our kernel off its tiles (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), as on an AMD Zen 4.

`--against REV` also times the decoder loop as it stood at git revision REV (`TargetModel._lean_forward` of
models/target.py there, and any helper of it the current class lacks, bound to the same loaded model), the two taking
turns at every size, and checks that both give the same logits: a change to the forward's Python measured side by
side. The figure is the median (`q1_ms`: the lower quartile, less of the machine's noise).

    python benchmarks/bench_step_cost.py --dtypes fp32 bf16 --isa native avx2 --linears packed dense
    OMP_NUM_THREADS=1 python benchmarks/bench_step_cost.py --isa native --dtypes bf16 --linears packed --tokens 1 2 4 8 \
        --reps 40 --against HEAD~1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads

configure_threads()  # before torch loads, and inherited by the children: the CLI's thread settings (threads.py)
ISA_ENV = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}  # avx512: a CPU with AMX held off its tiles (as a Zen 4)
ISA_FLAGS = {"avx512": {"avx512_bf16"}, "avx2": {"avx2", "fma"}}  # what the CPU needs for the held configuration


def runnable_isas(requested: list[str]) -> list[str]:
    """The requested ISA settings this CPU can run, in order; the others are named on stderr and skipped, since a
    library capped at an ISA the CPU lacks silently falls back to a lower one and the row would be mislabelled."""
    from trtllm_dflash.cpu import cpu_flags

    isas = [i for i in requested if ISA_FLAGS.get(i, set()) <= cpu_flags()]
    if skipped := [i for i in requested if i not in isas]:
        print(f"skipping {', '.join(skipped)}: this CPU lacks the instructions", file=sys.stderr, flush=True)
    return isas


def target_class_at(rev: str):
    """`TargetModel` as models/target.py stood at git revision `rev` (its own module globals)."""
    import types

    shown = subprocess.run(
        ["git", "show", f"{rev}:trtllm_dflash/models/target.py"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    if shown.returncode:
        raise SystemExit(
            f"--against {rev}: git cannot show trtllm_dflash/models/target.py there ({shown.stderr.strip()})."
        )
    module = types.ModuleType("trtllm_dflash.models._target_against")
    module.__package__ = "trtllm_dflash.models"
    exec(compile(shown.stdout, f"{rev}:trtllm_dflash/models/target.py", "exec"), module.__dict__)
    return module.TargetModel


def measure(
    target: str, dtype: str, tokens: list[int], reps: int, context: int, pack: bool, against: str | None = None
) -> dict:
    import types

    import torch

    from trtllm_dflash.engine.runtime import DTYPES
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.resolve import resolve_target

    tm = TargetModel.load(resolve_target(target, lambda m: None), DTYPES[dtype], pack=pack)
    cache = tm.new_cache(1, context + max(tokens) + 1)
    ids = torch.randint(100, 1000, (1, context + max(tokens)), generator=torch.Generator().manual_seed(0))
    tm.forward(ids[:, :context], 0, cache, capture=False, logits_to_keep=1)
    loops = {"current": types.MethodType(type(tm)._lean_forward, tm)}
    if against:
        if not tm.lean:
            raise SystemExit(f"--against: {target} does not run the lean decoder loop, the code it compares.")
        old = target_class_at(against)
        for name, fn in vars(old).items():  # helpers the loop called then that the current class no longer has
            if callable(fn) and not hasattr(tm, name):
                setattr(tm, name, types.MethodType(fn, tm))
        loops[against] = types.MethodType(old._lean_forward, tm)
    times = {(name, t): [] for name in loops for t in tokens}

    def forward(name: str, t: int):
        tm._lean_forward = loops[name]
        return tm.forward(ids[:, context : context + t], context, cache, capture=False)  # the same positions each time

    with torch.inference_mode():
        for t in tokens if against else ():  # both loops give the same logits
            if not torch.equal(*(forward(name, t)[0] for name in loops)):
                raise SystemExit(f"--against {against}: {t} tokens give other logits than the current loop's.")
        for i in range(
            reps + 2
        ):  # two warm-up rounds; sizes and loops take turns, so a drifting machine slows all alike
            for t in tokens:
                for name in list(loops)[i % len(loops) :] + list(loops)[: i % len(loops)]:
                    t0 = time.perf_counter()
                    forward(name, t)
                    if i >= 2:
                        times[name, t].append(time.perf_counter() - t0)
    out = {str(t): round(statistics.median(times["current", t]) * 1000, 3) for t in tokens}
    extra = {"q1_ms": {str(t): round(statistics.quantiles(times["current", t], n=4)[0] * 1000, 3) for t in tokens}}
    if against:
        extra["against"] = {
            "rev": against,
            "ms": {str(t): round(statistics.median(times[against, t]) * 1000, 3) for t in tokens},
            "q1_ms": {str(t): round(statistics.quantiles(times[against, t], n=4)[0] * 1000, 3) for t in tokens},
        }
    from trtllm_dflash.kernels import bf16_gemm

    return {
        "ms": out,
        "ratio_to_decode": {t: round(ms / out["1"], 3) for t, ms in out.items()},
        **extra,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "bf16_kernel": bf16_gemm.variant() if dtype == "bf16" and pack and bf16_gemm.kernel() is not None else None,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=list(ISA_ENV))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument(
        "--linears",
        nargs="+",
        default=["packed", "dense"],
        choices=["packed", "dense"],
        help="packed: the runtime's linears (weights prepacked for oneDNN, or for our bf16 kernel where the CPU "
        "has AVX-512 BF16 or AVX2 alone: kernels/bf16_gemm.py; TRTDFLASH_BF16_KERNEL=off keeps the library's); dense: stock F.linear.",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--against", metavar="REV", help="also time the decoder loop as of this git revision (e.g. HEAD~1)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step-cost.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run one (isa, dtype) in this process, print JSON
    args = ap.parse_args(argv)

    if args.child:
        dtype, linears = args.child.split(":")
        print(
            json.dumps(
                measure(args.target, dtype, args.tokens, args.reps, args.context, linears == "packed", args.against)
            )
        )
        return
    from trtllm_dflash.cpu import machine_info

    result = {
        "benchmark": "bench_step_cost",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "target": args.target,
        "context": args.context,
        "reps": args.reps,
        "against": args.against,
        "runs": {},
    }
    for isa in runnable_isas(args.isa):
        for dtype in args.dtypes:
            for linears in args.linears:
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    f"{dtype}:{linears}",
                    "--target",
                    args.target,
                    "--reps",
                    str(args.reps),
                    "--context",
                    str(args.context),
                    "--tokens",
                    *map(str, args.tokens),
                    *(["--against", args.against] if args.against else []),
                ]
                done = subprocess.run(cmd, env=os.environ | ISA_ENV[isa], capture_output=True, text=True, check=True)
                run = json.loads(done.stdout.strip().splitlines()[-1])
                result["runs"][f"{isa} {dtype} {linears}"] = run
                print(
                    f"{isa:6s} {dtype} {linears:6s}: "
                    + ", ".join(f"{t} tok {ms} ms ({run['ratio_to_decode'][t]}x)" for t, ms in run["ms"].items()),
                    flush=True,
                )
                if "against" in run:
                    print(
                        f"{'':6s} {dtype} {linears:6s} as of {args.against}: "
                        + ", ".join(f"{t} tok {ms} ms" for t, ms in run["against"]["ms"].items()),
                        flush=True,
                    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
