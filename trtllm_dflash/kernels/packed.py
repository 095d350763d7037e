"""Linear layers with weights prepacked once for oneDNN: the CPU's verify forward at close to decode cost.

A plain `F.linear` on CPU hands the weight to the BLAS, which repacks it into its blocked layout on every call once
more than one token comes in: for a 135M-parameter target in fp32 that is the whole 540 MB of weights read and
written again each forward, so verifying 8 tokens costs well over decoding one (docs/performance.md#packed-repack).
Reordered once into oneDNN's layout (what inductor's weight freezing does), a forward reads each weight once, as
decoding does. Each row's output does not depend on how many rows are in the call, so a token verified in a block
gets the same projection as decoding it alone. Inference only: the op has no backward.

bf16 weights on a CPU with AVX-512 BF16 take our own kernel instead (bf16_gemm.py: faster than oneDNN's for any
number of rows measured without AMX, and as fast for 8 rows as for one), and so do they where torch runs on AVX2
alone, where oneDNN does not pack bf16 at all. With AMX, calls of more than `bf16_gemm.TILE_ROWS` rows take oneDNN's
tile kernel, which keeps its own copy of the weight, made at the first such call. Elsewhere, one exception, measured
per process: where ATen's own kernel multiplies a single bf16 token faster than oneDNN's packed one (as it can, while
oneDNN's is far faster for 8 tokens; docs/performance.md#packed-one-token), a one-token call keeps the dense weight
and takes ATen's kernel. In fp32 oneDNN's packed kernel is the faster one everywhere measured.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.kernels import bf16_gemm

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-reordered weight. `weight` stays only where other code reads it (the LM
    head, often tied to the embeddings), where one-token calls use it (`aten_decodes_faster`) or where no packed kernel
    takes it (`packs`); elsewhere the dense copy is dropped, so memory does not double."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False, int8: bool = False):
        """`int8`: where our kernel multiplies int8 weights (bf16_gemm.int8_weights), keep the weight as int8 with a
        scale per output (a draft's: its guesses need not be the bf16 weights' bit for bit, verification decides)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.kernel = bf16_gemm.kernel() if bf16_gemm.fits(linear.weight) else None
        self.scale = None  # int8 weights' scale per output
        if self.kernel is not None:
            if int8 and bf16_gemm.int8_weights():
                self.packed, self.scale = bf16_gemm.pack_int8(linear.weight.detach())
            else:
                self.packed = self.kernel.pack(linear.weight.detach())
            self.kernel_bias = (
                None if linear.bias is None else linear.bias.detach().float().contiguous()
            )  # converted once
            self.one_token_dense = False
            self.tiled = bf16_gemm.tiles()  # calls of more than TILE_ROWS rows take oneDNN's tiles
            self.tiles = None  # their copy of the weight: made at the first such call (a batch-1 server makes none)
        elif can_pack(linear.weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
            self.one_token_dense = aten_decodes_faster(linear.weight.dtype)
            self.tiles = None
        else:  # bf16 where oneDNN packs none (AVX2 alone) and ours does not take this weight: ATen's kernel, dense
            self.packed, self.one_token_dense, self.tiles = None, False, None
        self.weight = linear.weight if keep_weight or self.one_token_dense or self.packed is None else None

    def use_q4(self, records: torch.Tensor) -> None:
        """Multiply 4-bit weights (bf16_gemm.pack_q4's records) instead of the packed bf16 ones: the same bits, from
        under a third of the bytes (q4_blocks.h)."""
        if self.kernel is None or self.scale is not None or self.tiled:
            raise ValueError("4-bit weights need our kernel's AVX-512 or AVX2 variant and a bf16 layer")
        self.packed, self.weight = records, None

    @property
    def q4(self) -> bool:
        return self.packed is not None and self.packed.dtype == torch.uint8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            return self.kernel.linear_int8(x, self.packed, self.scale, self.kernel_bias)
        if self.q4:
            return self.kernel.linear_q4(x, self.packed, self.kernel_bias)
        if self.kernel is not None:
            if not self.tiled or x.numel() <= bf16_gemm.TILE_ROWS * self.in_features:
                return self.kernel.linear(x, self.packed, self.kernel_bias)
            if self.tiles is None:
                self.tiles = torch.ops.mkldnn._reorder_linear_weight(bf16_gemm.unpack(self.packed))
            return torch.ops.mkldnn._linear_pointwise(x, self.tiles, self.bias, "none", [], "")
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self.one_token_dense and x.numel() == self.in_features:
            enabled = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)  # F.linear would otherwise route bf16 to oneDNN, repacking the weight
            try:
                return F.linear(x, self.weight, self.bias)
            finally:
                torch._C._set_mkldnn_enabled(enabled)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@functools.cache
def aten_decodes_faster(dtype: torch.dtype) -> bool:
    """Whether ATen's kernel (oneDNN off) multiplies one bf16 token by a weight clearly faster than oneDNN's packed
    kernel on this CPU: timed once per process over 48 MB of weights (more than a last-level cache holds, as a
    decode step's weights are), the two kernels' passes alternating (a machine still warming up slows both) and the
    best of 10 each; ATen must win by 10 %, so noise alone does not flip the choice."""
    if dtype != torch.bfloat16 or not can_pack(dtype):
        return False
    weights = [torch.full((2048, 1536), 0.01, dtype=dtype) for _ in range(8)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    x = torch.full((1, 1536), 0.01, dtype=dtype)
    enabled = torch._C._get_mkldnn_enabled()
    best = {"onednn": float("inf"), "aten": float("inf")}
    try:
        for _ in range(10):
            for kernel in best:
                torch._C._set_mkldnn_enabled(kernel == "onednn")
                t0 = time.perf_counter()
                for w, pw in zip(weights, packed):
                    if kernel == "onednn":
                        torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
                    else:
                        F.linear(x, w)
                best[kernel] = min(best[kernel], time.perf_counter() - t0)
    finally:
        torch._C._set_mkldnn_enabled(enabled)
    return best["aten"] < 0.9 * best["onednn"]


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


def packs(weight: torch.Tensor) -> bool:
    """Whether a PackedLinear of this weight runs a packed kernel here (oneDNN's or ours) rather than ATen's."""
    return weight.device.type == "cpu" and (
        can_pack(weight.dtype) or (bf16_gemm.fits(weight) and bf16_gemm.kernel() is not None)
    )


@torch.no_grad()
def pack_linears(model: nn.Module, keep: tuple[nn.Module, ...] = (), int8: bool = False) -> int:
    """Swap every plain nn.Linear of `model` (not subclasses: quantized layers keep their own forward) for a
    PackedLinear; the modules in `keep` keep their dense weight; `int8` as PackedLinear's. Returns how many were packed."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packs(child.weight):
                setattr(parent, name, PackedLinear(child, keep_weight=any(child is m for m in keep), int8=int8))
                packed += 1
    return packed
