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
    """The CPU's model name; where a virtual machine hides the model number (a bare "AMD EPYC"), with its family and
    model numbers, which tell the generations apart (AMD family 25 is Zen 3 and Zen 4, family 26 Zen 5)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or "unknown"
    if not any(c.isdigit() for c in name) and "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    return name


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def isa_summary() -> list[str]:
    """The flags that decide CPU inference speed here, for results files."""
    return sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
