"""4-bit weights read straight from the GGUF a preset target ships in, for the kernel that multiplies them as they are
(kernels/q4_blocks.h, bf16_gemm.pack_q4).

A preset's Hugging Face folder (resolve.py) keeps its GGUF beside the dequantized safetensors as `model.gguf`: the
safetensors serve every path that wants dense weights (training, export, ModelOpt), the GGUF's Q4_0 and Q4_1 tensors
the decode path, which then streams 0.625 bytes a weight instead of bf16's 2.

Invariant: `dequantized(codes)` is the bf16 weight the dense path loads for the same tensor (the GGUF conversion's
fp32 d * q + m, then nearest-even to bf16), so the kernel's rows equal the bf16 kernel's on it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trtllm_dflash.resolve import GGUF_FILE, hf_tensor, read_gguf

if TYPE_CHECKING:  # a build reads GGUF_FILE without loading torch
    import torch

Q4_0, Q4_1 = 2, 3  # ggml's GGMLQuantizationType values
BLOCK = 32  # weights per scale: ggml's QK4_0 and QK4_1, and the kernel's record width


@dataclass(frozen=True)
class Codes:
    """A 4-bit weight [n, k]: codes q in 0..15 and per output and block of 32 inputs a scale d and offset m (fp16):
    the weight is d * q + m."""

    q: np.ndarray  # uint8 [n, k]
    d: np.ndarray  # float16 [n, k / 32]
    m: np.ndarray  # float16 [n, k / 32]


def codes_of(kind: int, raw: bytes, shape: tuple[int, int]) -> Codes | None:
    """A Q4_1 tensor's codes (block: fp16 d, fp16 m, 16 bytes: element j in the low nibble of byte j, j + 16 in the
    high one), or a Q4_0 tensor's (fp16 d, 16 bytes; weight d * (q - 8)) as d * q + m with m = -8 d, exact where -8 d
    is an fp16 (else None: the tensor stays dense)."""
    n, k = shape
    width = 20 if kind == Q4_1 else 18
    blocks = np.frombuffer(raw, np.uint8).reshape(n, k // BLOCK, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., width - 16 :]
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(n, k)
    if kind == Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        with np.errstate(over="ignore"):
            m = (d * np.float16(-8)).astype(np.float16)
        if not np.isfinite(m[np.isfinite(d)]).all():
            return None
    return Codes(q, d, m)


def read_codes(path: Path) -> dict[str, Codes]:
    """Every Q4_0 and Q4_1 weight of the GGUF at `path`, by its Hugging Face name, rows in Hugging Face order."""
    meta, tensors = read_gguf(path)
    out = {}
    for name, (kind, shape, raw) in tensors.items():
        if kind not in (Q4_0, Q4_1) or len(shape) != 2 or shape[1] % BLOCK:
            continue
        codes = codes_of(kind, raw, shape)
        if codes is None:
            continue
        hf, rows = hf_tensor(meta, name, shape)
        out[hf] = Codes(codes.q[rows], codes.d[rows], codes.m[rows]) if rows is not None else codes
    return out


def dequantized(c: Codes) -> torch.Tensor:
    """The bf16 weight the dense path loads: fp32 d * q + m (d * q exact), rounded once to bf16."""
    import torch

    d = torch.from_numpy(c.d.astype(np.float32)).repeat_interleave(BLOCK, 1)
    m = torch.from_numpy(c.m.astype(np.float32)).repeat_interleave(BLOCK, 1)
    return (d * torch.from_numpy(c.q.astype(np.float32)) + m).to(torch.bfloat16)


def takes_four_bit(path: Path, dtype: str, weights: str) -> bool:
    """Whether a target loaded from `path` in `dtype` ("bf16", "fp32") with `weights` (config.WEIGHTS) multiplies its
    4-bit tensors as shipped: a bf16 target whose folder keeps its GGUF, where this CPU's kernel takes them by default
    (bf16_gemm.q4_weights)."""
    from trtllm_dflash.kernels import bf16_gemm

    return weights == "auto" and dtype == "bf16" and (Path(path) / GGUF_FILE).is_file() and bf16_gemm.q4_weights()
