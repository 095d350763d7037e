"""The draft's KV-injected block attention: the one attention no stock kernel does in one pass.

`block_attention` is the interface the runtime calls for every draft layer, batched over ragged rows:
each row attends from its block of Q queries to its own context cache (first `ctx_lens[i]` rows valid,
target-derived K/V) followed by the block's own K/V.

Every call goes through one torch custom op, `torch.ops.trtdflash.block_attention`, so the CPU runtime, the
tests, torch.compile, the ONNX export and a GPU run share a single call site:
    CPU (and any device without a kernel): `block_attention_reference` (masks + SDPA), the definition;
    CPU in bf16, where our bf16 kernel module runs (kernels/bf16_gemm.py) and outside tracing: its `block_attend`
      (kernels/slot_attention.h), called directly, as the op's Python dispatch alone costs more than the kernel
      (docs/performance.md#block-attention-dispatch);
    CUDA: the fused OpenAI Triton kernel in plugins/block_attention.py, imported on first CUDA call;
    fake/meta: shape inference for torch.compile / torch.export.
In the op's schema `window` is an int where 0 means "no window" (None in the Python API).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtllm_dflash.errors import DFlashError

OP = "trtdflash::block_attention"


def block_visibility(
    ctx_lens: torch.Tensor, q_len: int, ctx_cap: int, causal: bool, window: int | None
) -> torch.Tensor:
    """[b, 1, Q, C+Q] bool: which keys each block query sees (True = attend).

    Query t of row i sits at absolute position p = ctx_lens[i] + t. Context key j (position j) is
    visible iff j < ctx_lens[i] (the anchor's own feature does not exist yet); block key s (position
    ctx_lens[i] + s) always, or only s <= t on causal layers. A window W keeps keys with p - pos < W.
    """
    lens = ctx_lens.to(torch.long)[:, None, None]  # [b, 1, 1]
    t = torch.arange(q_len, device=ctx_lens.device)[None, :, None]  # [1, Q, 1]
    j = torch.arange(ctx_cap, device=ctx_lens.device)[None, None, :]  # [1, 1, C]
    s = torch.arange(q_len, device=ctx_lens.device)[None, None, :]  # [1, 1, Q]
    ctx = j < lens  # [b, 1, C]
    own = (s <= t) if causal else torch.ones(1, q_len, q_len, dtype=torch.bool, device=ctx_lens.device)
    if window is not None:
        ctx = ctx & (lens + t - j < window)  # [b, Q, C]
        own = own & (t - s < window)
    b = lens.shape[0]
    return torch.cat([ctx.expand(b, q_len, ctx_cap), own.expand(b, q_len, q_len)], dim=-1)[:, None]


def block_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Reference block attention (scale 1/sqrt(hd), GQA by head groups).

    q [b, nh, Q, hd]; k, v [b, nkv, Q, hd] the block's own (normed, roped) K/V;
    ctx_k, ctx_v [b, nkv, C, hd] the context caches, rows >= ctx_lens[i] ignored; ctx_lens [b] int.
    Returns [b, nh, Q, hd].
    """
    full = (
        not causal and window is None and bool((ctx_lens == ctx_k.shape[2]).all())
    )  # every key visible to every query
    mask = None if full else block_visibility(ctx_lens, q.shape[2], ctx_k.shape[2], causal, window)
    keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _check(q, k, v, ctx_k, ctx_v, ctx_lens, window) -> None:
    """Shape rules of the op, checked on metadata only (no device sync), once per call."""
    if q.dim() != 4 or any(t.dim() != 4 for t in (k, v, ctx_k, ctx_v)):
        raise DFlashError(
            "block_attention takes 4-D q [b, nh, Q, hd], k/v [b, nkv, Q, hd], ctx_k/ctx_v [b, nkv, C, hd]."
        )
    b, nh, q_len, hd = q.shape
    if k.shape != (b, k.shape[1], q_len, hd) or v.shape != k.shape:
        raise DFlashError(
            f"block_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [b, nkv, Q, hd] matching q {tuple(q.shape)}."
        )
    nkv = k.shape[1]
    if nkv == 0 or nh % nkv:
        raise DFlashError(f"block_attention: {nh} query heads are not a multiple of {nkv} KV heads.")
    if ctx_k.shape[:2] != (b, nkv) or ctx_k.shape[3] != hd or ctx_v.shape != ctx_k.shape:
        raise DFlashError(
            f"block_attention: ctx_k {tuple(ctx_k.shape)} and ctx_v {tuple(ctx_v.shape)} must be [b, nkv, C, hd] = [{b}, {nkv}, C, {hd}]."
        )
    if ctx_lens.shape != (b,) or ctx_lens.dtype not in (torch.int32, torch.int64):
        raise DFlashError(
            f"block_attention: ctx_lens must be int32/int64 of shape [{b}], got {ctx_lens.dtype} {tuple(ctx_lens.shape)}."
        )
    if len({t.dtype for t in (q, k, v, ctx_k, ctx_v)}) != 1:
        raise DFlashError("block_attention: q, k, v, ctx_k and ctx_v must share one dtype.")
    if window is not None and window < 1:
        raise DFlashError(f"block_attention: window must be at least 1 (or None for full attention), got {window}.")


def _tracing() -> bool:
    """Under torch.compile, torch.export or the ONNX exporter, where only the op is visible to the tracer."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _cpu_kernel():
    """Our bf16 kernel module where it runs on this CPU (kernels/bf16_gemm.py), else None."""
    from trtllm_dflash.kernels import bf16_gemm

    return bf16_gemm.kernel()


@torch.library.custom_op(OP, mutates_args=())
def _block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    causal: bool,
    window: int,
) -> torch.Tensor:
    """Default implementation (CPU and every device without a kernel): the reference; contiguous output."""
    return block_attention_reference(q, k, v, ctx_k, ctx_v, ctx_lens, causal, window or None).contiguous()


@_block_attention_op.register_kernel("cuda")
def _block_attention_cuda(q, k, v, ctx_k, ctx_v, ctx_lens, causal, window):
    from trtllm_dflash.plugins.block_attention import block_attention as triton_block_attention  # GPU-only: triton

    return triton_block_attention(q, k, v, ctx_k, ctx_v, ctx_lens, causal, window)


@_block_attention_op.register_fake
def _block_attention_fake(q, k, v, ctx_k, ctx_v, ctx_lens, causal, window):
    return q.new_empty(q.shape)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    causal: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """Block attention through the custom op (see the module docstring); same contract as the reference.

    q [b, nh, Q, hd]; k, v [b, nkv, Q, hd]; ctx_k, ctx_v [b, nkv, C, hd]; ctx_lens [b] int. Returns [b, nh, Q, hd].
    """
    _check(q, k, v, ctx_k, ctx_v, ctx_lens, window)
    if window is None and q.dtype == torch.bfloat16 and q.device.type == "cpu" and not _tracing():
        cpu = _cpu_kernel()
        if (
            cpu is not None
            and q.shape[3] in cpu.ATTEND_HEAD_DIMS
            and all(t.stride(3) == 1 for t in (q, k, v, ctx_k, ctx_v))
        ):
            return cpu.block_attend(q, k, v, ctx_k, ctx_v, ctx_lens, bool(causal), q.shape[3] ** -0.5)
    return torch.ops.trtdflash.block_attention(
        q, k, v, ctx_k, ctx_v, ctx_lens, bool(causal), 0 if window is None else int(window)
    )
