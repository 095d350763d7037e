"""What this CPU is and which instructions it has, from /proc/cpuinfo: the facts every layer reads (the kernels
choose their variant from them, results files record them). Nothing here imports the rest of the package."""

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
