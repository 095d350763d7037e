"""What this CPU is and which dtype runs DFlash fastest on it, decided once for generate, build and quickstart.

bf16 wherever our bf16 kernels or oneDNN's multiply it at speed, where it decodes faster than fp32
(docs/performance.md#cpu-bf16-default): a CPU with AVX-512 BF16 or AMX, or torch on AVX2 alone with our kernel's AVX2
variant built (`fastest_dtype`). fp32 is the dtype whose greedy output equals the target's own
`generate()`; bf16's is our runtime's (`benchmarks/bench_bf16_agreement.py`)"""

from __future__ import annotations

import functools
import platform

from trtllm_dflash.cpuinfo import BF16_HARDWARE_FLAGS, cpu_flags, cpu_model, isa_summary

__all__ = [
    "BF16_HARDWARE_FLAGS",
    "cpu_flags",
    "cpu_model",
    "isa_summary",
    "machine_info",
    "fastest_dtype",
    "resolve_dtype",
    "trains_in_bf16",
]


def machine_info() -> dict:
    """The machine facts every results file and training card records."""
    import os

    import torch
    import transformers

    from trtllm_dflash.kernels import bf16_gemm

    return {
        "cpu": cpu_model(),
        "isa": isa_summary(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
        "openmp": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        # where set, torch and our kernels ran as on a CPU with less (bf16_gemm.variant): "bf16_kernel" names the one
        "isa_limits": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ},
        "bf16_kernel": bf16_gemm.variant(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@functools.cache
def fastest_dtype() -> str:
    """'bf16' where the CPU has bf16 arithmetic and oneDNN packs bf16 weights, or where torch runs on AVX2 alone and
    our kernel's AVX2 variant is built (bf16 weights, fp32 arithmetic: half the bytes to read, so faster than fp32;
    docs/performance.md#cpu-avx2-bf16); else 'fp32'."""
    import torch

    from trtllm_dflash.kernels import bf16_gemm
    from trtllm_dflash.kernels.packed import can_pack

    if cpu_flags() & set(BF16_HARDWARE_FLAGS) and can_pack(torch.bfloat16):
        return "bf16"
    if bf16_gemm.variant() == "avx2" and bf16_gemm.kernel() is not None:
        return "bf16"
    return "fp32"


def trains_in_bf16() -> bool:
    """Whether bf16 autocast is the faster way to train a draft here: on CPUs with bf16 arithmetic (AVX-512 BF16,
    AMX). Training runs torch's own kernels, which on AVX2 alone emulate bf16 matrix products, many times slower than
    fp32 (docs/performance.md#cpu-train-dtype)."""
    return bool(cpu_flags() & set(BF16_HARDWARE_FLAGS))


def resolve_dtype(name: str) -> str:
    """A --dtype value as 'fp32' or 'bf16'."""
    from trtllm_dflash.config import DTYPE_CHOICES
    from trtllm_dflash.errors import DFlashError

    if name not in DTYPE_CHOICES:
        raise DFlashError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}.")
    return fastest_dtype() if name == "auto" else name
