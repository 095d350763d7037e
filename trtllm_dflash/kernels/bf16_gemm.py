"""Our bf16 matrix kernels: a decode step and a verify both read the weights once at memory speed, and a row's
projection does not depend on the rows beside it.

- `avx512` (bf16_gemm.cpp), for CPUs with AVX-512 BF16: VDPBF16PS. It costs about the same for any of 1-8 rows and
  beats oneDNN's packed bf16 kernel and ATen's one-row kernel (docs/performance.md#bf16-kernel-avx512). For up to 6
  rows a pass takes 2-4 blocks of outputs at once, so a verify's few rows cost about what one row does
  (docs/performance.md#bf16-kernel-avx512-blocks).
- `amx` (bf16_gemm.cpp built with AMX), for CPUs with AMX-BF16: the same packed weights fed to AMX's tile multiply,
  16 rows at a time, for calls of up to `TILE_ROWS` rows (more take oneDNN's tile kernel: `PackedLinear`): 16 rows
  cost about what one does (docs/performance.md#bf16-kernel-amx). A pass takes three blocks of outputs, which is
  faster and gives the same bits (docs/performance.md#bf16-kernel-amx-blocks). Its sums add each pair of products in
  another order than VDPBF16PS's, so a few outputs in ten thousand round apart from the `avx512` variant's; every
  row's still does not depend on the rows beside it.
- `avx2` (bf16_gemm_avx2.cpp), where torch runs on AVX2 alone and bf16 matrix products are emulated: bf16 weights
  widened to fp32 in registers, FMA, two rows a pass; more rows take each block in 4 KB chunks, every pair of rows
  passing over a chunk while memory streams the next, which beats whole-block passes from 4 rows up
  (docs/performance.md#bf16-kernel-avx2-chunks). It also multiplies int8 weights with a scale per output
  (`linear_int8`, `pack_int8`), which a draft's linears keep there (`int8_weights`): the same arithmetic over half
  the bytes, so faster than bf16 weights (docs/performance.md#bf16-kernel-int8).

Both the `avx512` and the `avx2` variant also multiply 4-bit weights as a GGUF ships them (`linear_q4`, q4_blocks.h):
each record of 32 outputs x 32 inputs is decoded once into the bf16 lines above and the variant's own row loop runs
over them, so a row has the bits `linear` gives on the dequantized weights, from under a third of the bytes. A target
uses them by default where that pays (`q4_weights`: the `avx512` variant; docs/performance.md#q4-kernel).

Each is compiled on first use with the system C++ compiler (torch's cpp_extension; the kernel source and the Python
bindings, `bindings.cpp`, side by side on two cores; seconds, once (docs/performance.md#bf16-kernel-compile), then
cached under the trtllm_dflash cache) and used only where the CPU has its instructions; where none is built (no
compiler, another CPU, `TRTDFLASH_BF16_KERNEL=off`), linears keep oneDNN's and ATen's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from importlib import resources

import torch

BLOCK = 32  # outputs per block of the packed layout (every variant packs alike)
_AVX512 = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-fopenmp"]
VARIANTS = {  # name -> (kernel source, compiler flags)
    "amx": ("bf16_gemm.cpp", [*_AVX512, "-mamx-tile", "-mamx-bf16"]),
    "avx512": ("bf16_gemm.cpp", _AVX512),
    "avx2": ("bf16_gemm_avx2.cpp", ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DTRTDFLASH_INT8"]),
}
BINDINGS = "bindings.cpp"  # every variant's Python module, compiled beside its kernel source (kernels.h: why)
HEADERS = (
    "kernels.h",
    "bf16_blocks.h",
    "slot_attention.h",
    "rms_norm.h",
    "activation.h",
    "argmax.h",
    "decoder_layer.h",
    "q4_blocks.h",
)
# what every variant compiles in: the entry points, the layout and loop, a step's attention, RMSNorm, the MLP's
# activation, argmax, a decoder layer's step in one call
ENV = "TRTDFLASH_BF16_KERNEL"  # "off": keep the library kernels (A/B timing, or a compiler that misbehaves)
TILE_ROWS = 64  # on a CPU with AMX, linears of more rows take oneDNN's tile kernel (faster for long prompt chunks);
# decode steps, verified blocks and batches up to this many tokens share ours (the same text alone and batched)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] weight back from its packed [N/32, K/2, 32, 2] layout (bf16_blocks.h: pack), for a library
    kernel that wants its own copy (`PackedLinear`'s oneDNN tiles)."""
    n_blocks, half_k, block, pair = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(n_blocks * block, half_k * pair)


def int8_weights() -> bool:
    """Whether this CPU's kernel multiplies int8 weights (`linear_int8`: the avx2 variant). Where it does, a draft's
    linears keep int8 weights (runtime.py): half the bytes a drafting step streams, where memory, not arithmetic, bounds
    its few rows."""
    return variant() == "avx2" and kernel() is not None


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight [N, K] as symmetric int8, one fp32 scale per output (its largest magnitude / 127), laid out as
    `linear_int8` reads it: [N/32, K/2, 2, 32], per block of 32 outputs and input pair, the outputs' weights for the
    pair's even input, then for the odd. Returns (packed, scales [N])."""
    n, k = weight.shape
    w = weight.float()
    scale = w.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return q.view(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 3, 1).contiguous(), scale


def unpack_int8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight `pack_int8` quantized, dequantized to fp32 [N, K]."""
    n_blocks, half_k = packed.shape[:2]
    return packed.permute(0, 3, 1, 2).reshape(n_blocks * BLOCK, half_k * 2).float() * scale[:, None]


Q4_VARIANTS = ("avx512",)  # where a target's 4-bit weights are multiplied as they are by default: the decode costs
# less than the bytes it saves there; on AVX2 it computes the same bits but costs more than it saves at a verify's rows
# (docs/performance.md#q4-kernel); with AMX the bf16 tile kernel's sums round apart from VDPBF16PS's


def q4_weights() -> bool:
    """Whether this CPU's kernel multiplies a target's 4-bit weights (`linear_q4`) by default."""
    return variant() in Q4_VARIANTS and kernel() is not None


def pack_q4(codes) -> torch.Tensor:
    """4-bit codes (models/gguf4.Codes: q [N, K], d and m [N, K/32]) as `linear_q4` reads them (q4_blocks.h): per block
    of 32 outputs and 32 inputs a 640-byte record, d[32] and m[32] in fp16, then 16 lines of 32 bytes, output j's codes
    for inputs 2l and 2l + 1 in byte j's low and high nibble. [N/32, K/32, 640] uint8."""
    import numpy as np

    n, k = codes.q.shape
    nb, kb = n // BLOCK, k // BLOCK
    q = codes.q.reshape(nb, BLOCK, kb, BLOCK // 2, 2)
    lines = (q[..., 0] | (q[..., 1] << 4)).transpose(0, 2, 3, 1).reshape(nb, kb, BLOCK * BLOCK // 2)

    def per_record(a):  # [N, K/32] fp16 -> [N/32, K/32, 64] bytes
        return np.ascontiguousarray(a.reshape(nb, BLOCK, kb).transpose(0, 2, 1)).view(np.uint8)

    return torch.from_numpy(np.concatenate([per_record(codes.d), per_record(codes.m), lines], -1))


def fits(weight: torch.Tensor) -> bool:
    """A weight this kernel can multiply: bf16, [N, K] with N a multiple of 32 and K even."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % BLOCK == 0
        and weight.shape[1] % 2 == 0
    )


@functools.cache
def amx_permitted() -> bool:
    """Linux gives a process AMX's tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16 on; a
    tile instruction before that kills the process). Asked once, before our kernel runs one."""
    import ctypes

    try:  # x86-64: SYS_arch_prctl 158, ARCH_REQ_XCOMP_PERM 0x1023, XFEATURE_XTILEDATA 18
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


def onednn_takes_amx() -> bool:
    """Whether oneDNN may use AMX here: not where `ONEDNN_MAX_CPU_ISA` holds it below (e.g. AVX512_CORE_BF16)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return isa in ("ALL", "DEFAULT") or "AMX" in isa


def variant() -> str | None:
    """The kernel for this CPU as torch and oneDNN see it, or None: AVX-512 without BF16 (oneDNN's, not measured
    against ours) or `TRTDFLASH_BF16_KERNEL=off`. So an AMX Xeon can run as the other CPUs do: ATEN_CPU_CAPABILITY=avx2
    with ONEDNN_MAX_CPU_ISA=AVX2 as one with AVX2 alone, ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 as one with AVX-512 BF16
    and no AMX (an AMD Zen 4)."""
    from trtllm_dflash.cpuinfo import cpu_flags

    flags, capability = cpu_flags(), torch.backends.cpu.get_cpu_capability()
    if os.environ.get(ENV, "on") == "off":
        return None
    if capability == "AVX512" and "avx512_bf16" in flags:
        return "amx" if {"amx_tile", "amx_bf16"} <= flags and onednn_takes_amx() and amx_permitted() else "avx512"
    if capability == "AVX2" and {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def tiles() -> bool:
    """Whether oneDNN's AMX tile kernel takes linears of more than `TILE_ROWS` rows here. Then a row's projection
    depends on whether its forward has more rows than that, so bf16 batches and their rows alone may round apart."""
    return variant() == "amx"


@functools.cache
def kernel():
    """The compiled extension (`pack`, `linear`) for this CPU, or None where none runs here (the reason said once on
    stderr)."""
    name = variant()
    if name is None:
        return None
    from torch.utils.cpp_extension import load

    from trtllm_dflash.resolve import cache_dir

    filename, flags = VARIANTS[name]
    module_name = f"trtdflash_bf16_gemm_{name}"
    package = resources.files(__package__)
    text = b"".join(
        (package / f).read_bytes() for f in (filename, BINDINGS, *HEADERS)
    )  # the headers: beside the sources
    build = (
        cache_dir() / "kernels" / f"bf16_gemm_{name}-{hashlib.sha256(text + ' '.join(flags).encode()).hexdigest()[:16]}"
    )
    built = build / f"{module_name}.so"
    if built.is_file() and not (build / "lock").exists():  # built from this very source, and no build under way (the
        # lock is cpp_extension's): import it directly, as cpp_extension's checks take a second
        spec = importlib.util.spec_from_file_location(module_name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    print(
        f"trtllm_dflash: building the bf16 matrix kernel for this CPU ({name}; once, about 10 s) in {build}",
        file=sys.stderr,
    )
    try:
        build.mkdir(parents=True, exist_ok=True)
        with resources.as_file(package / filename) as source, resources.as_file(package / BINDINGS) as bindings:
            return load(
                name=module_name,
                sources=[str(source), str(bindings)],
                build_directory=str(build),
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a read-only cache: the library kernels still work
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"trtllm_dflash: the bf16 matrix kernel could not be built ({reason[:200]}); using the library's.",
            file=sys.stderr,
        )
        return None
