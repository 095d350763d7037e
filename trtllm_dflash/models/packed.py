"""Linear layers with weights prepacked once for oneDNN: the CPU's verify forward at close to decode cost.

A plain `F.linear` on CPU hands the weight to the BLAS, which repacks it into its blocked layout on every call once
more than one token comes in: for a 135M-parameter target in fp32 that is the whole 540 MB of weights read and
written again each forward, so verifying 8 tokens cost 1.8x decoding one (AMD EPYC, 2026-11-23). Reordered once
into oneDNN's layout (what inductor's weight freezing does), a forward reads each weight once, as decoding does.
Each row's output does not depend on how many rows are in the call, so a token verified in a block gets the
same projection as decoding it alone. Inference only: the op has no backward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-reordered weight. `weight` stays only where other code reads it (the LM
    head, often tied to the embeddings); elsewhere the dense copy is dropped, so memory does not double."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN is there and packs this dtype on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT: not on AVX2-only)."""
    if not (torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


@torch.no_grad()
def pack_linears(model: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """Swap every plain nn.Linear of `model` (not subclasses: quantized layers keep their own forward) for a
    PackedLinear; the modules in `keep` keep their dense weight. Returns how many were packed."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and can_pack(child.weight.dtype):
                setattr(parent, name, PackedLinear(child, keep_weight=any(child is m for m in keep)))
                packed += 1
    return packed
