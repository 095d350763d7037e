"""Our bf16 matrix kernel (trtllm_dflash/kernels/bf16_gemm.py) against the library kernels, over all of a target's
linear layers at once (one forward's worth of weights, more than the caches hold), by number of rows.
Backs: docs/performance.md#bf16-kernel-avx512 (ours 7.8-8.5 ms for 1-8 rows against oneDNN's 11.4-13.8; the other
bf16-kernel-* paragraphs beside it). Reproduce: python benchmarks/bench_bf16_kernel.py --rows 1 2 4 8 16 32 80 256.

Natively (`--isa native`, a CPU with AVX-512 BF16): ours, oneDNN's packed bf16 kernel (what `PackedLinear` uses where
ours does not run) and, for one row, ATen's kernel (oneDNN off: what `PackedLinear` took for single bf16 tokens before
ours). With `--isa avx2` (a child process with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2: torch as on a CPU
with AVX2 alone) ours is the FMA variant, against ATen's emulated bf16 kernel (what bf16 linears ran there before) and
oneDNN's packed fp32 kernel (what `--dtype fp32` runs there, and `--dtype auto` where ours cannot be built). Random
weights of the target's shapes; the kernels take turns per round and each figure is the fastest of `--reps` rounds
(`median_ms`: their median). The CLI's thread settings.

Where our kernel also multiplies int8 weights (`bf16_gemm.int8_weights`: the AVX2 variant; a draft's linears take
them there), `ours_int8` times the same weights quantized by `bf16_gemm.pack_int8`.

`--against REV` also builds our kernel as it was at git revision REV (its source and headers, `git show`) and times it
in the same rounds, `ours@REV`, checking that both give the same bits: a kernel change measured side by side.

    python benchmarks/bench_bf16_kernel.py --rows 1 2 4 8 16 32 80 256
    python benchmarks/bench_bf16_kernel.py --isa avx2 --rows 1 2 4 8 16 32 80 256
    OMP_NUM_THREADS=1 python benchmarks/bench_bf16_kernel.py --rows 1 2 8 16 --reps 15 --against HEAD~1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from trtllm_dflash.threads import configure_threads

configure_threads()  # before torch loads (threads.py)
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent


def kernel_at(rev: str, name: str):
    """Our kernel variant `name` as its source stood at git revision `rev`, built apart from the current one."""
    from torch.utils.cpp_extension import load

    from trtllm_dflash.kernels import bf16_gemm

    filename, flags = bf16_gemm.VARIANTS[name]
    build = Path(tempfile.mkdtemp(prefix="bf16-kernel-"))
    sources = []
    for f in (filename, bf16_gemm.BINDINGS, *bf16_gemm.HEADERS):
        shown = subprocess.run(["git", "show", f"{rev}:trtllm_dflash/models/{f}"], cwd=REPO, capture_output=True)
        if shown.returncode and f in (bf16_gemm.BINDINGS, "kernels.h"):
            continue  # a revision before 2026-11-29's split: its kernel source holds its bindings and declarations
        if shown.returncode:
            raise SystemExit(
                f"--against {rev}: git cannot show trtllm_dflash/models/{f} there ({shown.stderr.decode().strip()})."
            )
        (build / f).write_bytes(shown.stdout)
        sources += [str(build / f)] if f.endswith(".cpp") else []
    print(f"building our {name} kernel as of {rev} in {build}...", file=sys.stderr, flush=True)
    return load(
        name=f"trtdflash_bf16_gemm_{name}_against",
        sources=sources,
        build_directory=str(build),
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 80, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--against", metavar="REV", help="also time our kernel as of this git revision (e.g. HEAD~1)")
    ap.add_argument(
        "--out", default=None, help="default: benchmarks/results/bf16-kernel.json (native), bf16-kernel-avx2.json"
    )
    args = ap.parse_args(argv)
    args.out = args.out or str(RESULTS / ("bf16-kernel.json" if args.isa == "native" else "bf16-kernel-avx2.json"))
    if args.isa == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":  # torch reads it when it loads: a child
        raise SystemExit(
            subprocess.run(
                [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=os.environ | AVX2
            ).returncode
        )

    import torch
    from transformers import AutoConfig

    from trtllm_dflash.cpu import machine_info
    from trtllm_dflash.kernels import bf16_gemm
    from trtllm_dflash.kernels.packed import can_pack
    from trtllm_dflash.resolve import resolve_target

    ours = bf16_gemm.kernel()
    if ours is None:
        raise SystemExit(
            "Our bf16 kernel does not run on this CPU (it needs AVX-512 BF16, or AVX2 alone); nothing to compare."
        )
    c = AutoConfig.from_pretrained(resolve_target(args.target, lambda m: None))
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    shapes = [
        (qkv, c.hidden_size),
        (c.hidden_size, c.num_attention_heads * hd),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ] * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]  # fused, as the runtime's
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for n, k in shapes]

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    kernels = {"ours": ([ours.pack(w) for w in weights], lambda x, w: ours.linear(x, w, None))}
    if args.against:
        old = kernel_at(args.against, bf16_gemm.variant())
        kernels[f"ours@{args.against}"] = ([old.pack(w) for w in weights], lambda x, w: old.linear(x, w, None))
    if bf16_gemm.int8_weights():
        kernels["ours_int8"] = ([bf16_gemm.pack_int8(w) for w in weights], lambda x, w: ours.linear_int8(x, *w, None))
    if can_pack(torch.bfloat16):
        kernels["onednn"] = ([torch.ops.mkldnn._reorder_linear_weight(w) for w in weights], onednn)
    else:  # AVX2 alone: fp32's kernel (--dtype fp32, or auto where ours cannot be built), fed the same inputs in fp32
        kernels["onednn_fp32"] = (
            [torch.ops.mkldnn._reorder_linear_weight(w.float()) for w in weights],
            lambda x, w: onednn(x.float(), w),
        )

    def aten(x, w):
        torch._C._set_mkldnn_enabled(False)
        try:
            return torch.nn.functional.linear(x, w)
        finally:
            torch._C._set_mkldnn_enabled(True)

    result = {
        "benchmark": "bench_bf16_kernel",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "isa": args.isa,
        "kernel": bf16_gemm.variant(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "target": args.target,
        "linears": len(shapes),
        "weight_mb": round(sum(n * k for n, k in shapes) * 2 / 2**20, 1),
        "reps": args.reps,
        "against": args.against,
        "ms": {},
        "median_ms": {},
        "same_bits_as_against": {},
    }
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
            runs = dict(kernels) | ({"aten": (weights, aten)} if m == 1 or args.isa == "avx2" else {})
            times = {name: [] for name in runs}
            for rep in range(args.reps + 1):  # round 0 warms every kernel up and is not counted
                for name, (packed, f) in runs.items():
                    t0 = time.perf_counter()
                    for w, (_, k) in zip(packed, shapes):
                        f(xs[k], w)
                    if rep:
                        times[name].append(time.perf_counter() - t0)
            result["ms"][str(m)] = {name: round(min(t) * 1000, 2) for name, t in times.items()}
            result["median_ms"][str(m)] = {name: round(statistics.median(t) * 1000, 2) for name, t in times.items()}
            if args.against:
                (new_w, f_new), (old_w, f_old) = kernels["ours"], kernels[f"ours@{args.against}"]
                result["same_bits_as_against"][str(m)] = all(
                    torch.equal(f_new(xs[k], a), f_old(xs[k], b)) for a, b, (_, k) in zip(new_w, old_w, shapes)
                )
            print(
                f"{m:4d} rows: "
                + ", ".join(
                    f"{name} {ms} ms (median {result['median_ms'][str(m)][name]})"
                    for name, ms in result["ms"][str(m)].items()
                )
                + (f", same bits: {result['same_bits_as_against'][str(m)]}" if args.against else ""),
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
