"""What this CPU is and which dtype runs DFlash fastest on it, decided once for generate, build and quickstart.

bf16 wherever our bf16 kernels or oneDNN's multiply it at speed: a CPU with AVX-512 BF16 or AMX (bf16 DFlash 51.0
tok/s against fp32's 44.3 on an AMD EPYC with AVX-512 BF16, 2026-11-23, `benchmarks/bench_generate.py`; on an AMX
Xeon 63.5 against 29.0 on GSM8K, 2026-11-26, `speedup-xeon-amx-20261126.json`), or torch on AVX2 alone with our
kernel's AVX2 variant built (`fastest_dtype`). fp32 is the dtype whose greedy output equals the target's own
`generate()`; bf16's is our runtime's (`benchmarks/bench_bf16_agreement.py`)"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BF16_HARDWARE_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return {}
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def isa_summary() -> list[str]:
    """The flags that decide CPU inference speed here, for results files."""
    return sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))


def machine_info() -> dict:
    """The machine facts every results file and training card records."""
    import os

    import torch
    import transformers

    from .models import bf16_gemm

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
    our kernel's AVX2 variant is built (bf16 weights, fp32 arithmetic: DFlash 59.4 against fp32's 31.6 tokens/s through
    the CLI on GSM8K, AMD EPYC Zen 4 with ATEN_CPU_CAPABILITY=avx2, 2026-11-26, `benchmarks/results/speedup-20261126-0204-avx2.json`); else
    'fp32'."""
    import torch

    from .models import bf16_gemm
    from .models.packed import can_pack

    if cpu_flags() & set(BF16_HARDWARE_FLAGS) and can_pack(torch.bfloat16):
        return "bf16"
    if bf16_gemm.variant() == "avx2" and bf16_gemm.kernel() is not None:
        return "bf16"
    return "fp32"


def trains_in_bf16() -> bool:
    """Whether bf16 autocast is the faster way to train a draft here: on CPUs with bf16 arithmetic (AVX-512 BF16,
    AMX). Training runs torch's own kernels, which on AVX2 alone emulate bf16 matrix products: a `train-draft` step
    took over a minute in bf16 against 3 s in fp32 (2 threads, AMD EPYC Zen 3, 2026-11-28, informal)."""
    return bool(cpu_flags() & set(BF16_HARDWARE_FLAGS))


def resolve_dtype(name: str) -> str:
    """A --dtype value as 'fp32' or 'bf16'."""
    from .config import DTYPE_CHOICES
    from .errors import DFlashError

    if name not in DTYPE_CHOICES:
        raise DFlashError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}.")
    return fastest_dtype() if name == "auto" else name
