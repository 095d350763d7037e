"""The draft's KV-injected block attention as one fused OpenAI Triton kernel.

One program per (row, KV head, query tile): the tile packs the GROUP query heads that share the KV head
with the row's Q block queries (GROUP x Q <= 8 x 16 = 128 rows), so each key/value tile is read once per
KV head and feeds a real matrix product even though a block has only 1-16 queries. The program streams
the row's own context cache (only [max(0, L-W+1), L) is ever read, L = ctx_lens[row]), then the block's
own K/V, with the visibility rule of `trtllm_dflash.kernels.block_visibility` applied per score and an
online (running max / running sum) softmax in fp32. Ragged batches need no padding work: each row stops
at its own L. The same source runs on CUDA and, under TRITON_INTERPRET=1, on CPU tensors (the tests).

Imported only where a kernel launch happens (the op's CUDA implementation, the TensorRT plugin, the
interpreter tests): `import triton` never happens on the CPU runtime path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """a @ b accumulated in fp32. F32_DOT: operands widened to fp32 and multiplied exactly (IEEE, no TF32) --
    fp32 inputs, and the CPU interpreter, whose bf16 dot is wrong; a bf16 x bf16 product is exact in fp32,
    so this is the tensor-core bf16 dot up to summation order."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _block_attention_kernel(
    Q, K, V, CK, CV, LENS, O,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_kt, s_kd,
    s_vb, s_vh, s_vt, s_vd,
    s_ckb, s_ckh, s_ckt, s_ckd,
    s_cvb, s_cvh, s_cvt, s_cvd,
    s_ob, s_oh, s_ot, s_od,
    ctx_cap, q_len, head_dim, window, qk_scale,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (head in group, query) index
    g = m // q_len
    t = m % q_len
    m_ok = m < GROUP * q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    head = kvh * GROUP + g

    q = tl.load(Q + row * s_qb + head[:, None] * s_qh + t[:, None] * s_qt + d[None, :] * s_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    ctx_len = tl.load(LENS + row).to(tl.int32)
    pos = ctx_len + t  # absolute position of each query
    # A finite floor (not -inf) keeps exp2(m_old - m_new) defined for rows whose keys so far were all masked.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Context keys: valid below ctx_len (and below the capacity); a window hides everything before L-W+1.
    hi = tl.minimum(ctx_len, ctx_cap)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx_len - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        kt = tl.load(CK + row * s_ckb + kvh * s_ckh + j[None, :] * s_ckt + d[:, None] * s_ckd,
                     mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, kt, F32_DOT) * qk_scale
        visible = j_ok[None, :]
        if WINDOWED:
            visible = visible & (pos[:, None] - j[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(CV + row * s_cvb + kvh * s_cvh + j[:, None] * s_cvt + d[None, :] * s_cvd,
                     mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(vv.dtype), vv, F32_DOT)
        m_i = m_new

    # The block's own keys (position ctx_len + s): all of them, or s <= t on causal layers.
    sk = tl.arange(0, BLOCK_Q)
    sk_ok = sk < q_len
    kt = tl.load(K + row * s_kb + kvh * s_kh + sk[None, :] * s_kt + d[:, None] * s_kd,
                 mask=sk_ok[None, :] & d_ok[:, None], other=0.0)
    s = _dot(q, kt, F32_DOT) * qk_scale
    visible = sk_ok[None, :]
    if CAUSAL:
        visible = visible & (sk[None, :] <= t[:, None])
    if WINDOWED:
        visible = visible & (t[:, None] - sk[None, :] < window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = tl.load(V + row * s_vb + kvh * s_vh + sk[:, None] * s_vt + d[None, :] * s_vd,
                 mask=sk_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(vv.dtype), vv, F32_DOT)

    out = acc / l_i[:, None]  # every query sees at least its own key, so l_i > 0 on real rows
    tl.store(O + row * s_ob + head[:, None] * s_oh + t[:, None] * s_ot + d[None, :] * s_od,
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def launch_config(q: torch.Tensor, k: torch.Tensor) -> dict:
    """Tile sizes for one call: tl.dot needs every dimension >= 16 and a power of two."""
    group, q_len, head_dim = q.shape[1] // k.shape[1], q.shape[2], q.shape[3]
    return {
        "BLOCK_M": min(128, max(16, triton.next_power_of_2(group * q_len))),
        "BLOCK_N": 64 if head_dim <= 64 else 32,
        "BLOCK_Q": max(16, triton.next_power_of_2(q_len)),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
    }


def block_attention_into(out: torch.Tensor, q, k, v, ctx_k, ctx_v, ctx_lens, causal: bool, window: int) -> torch.Tensor:
    """Launch the kernel writing `out` [b, nh, Q, hd] (any strides); window <= 0 means no window.

    Shapes are the op's (checked by `trtllm_dflash.kernels.block_attention`); the TensorRT plugin calls this
    with tensors viewed over TensorRT's buffers, the torch op with a fresh output.
    """
    b, nh, q_len, hd = q.shape
    nkv = k.shape[1]
    cfg = launch_config(q, k)
    grid = (b, nkv, triton.cdiv((nh // nkv) * q_len, cfg["BLOCK_M"]))
    _block_attention_kernel[grid](
        q, k, v, ctx_k, ctx_v, ctx_lens, out,
        *q.stride(), *k.stride(), *v.stride(), *ctx_k.stride(), *ctx_v.stride(), *out.stride(),
        ctx_k.shape[2], q_len, hd, max(int(window), 0), LOG2E / math.sqrt(hd),
        GROUP=nh // nkv, CAUSAL=bool(causal), WINDOWED=int(window) > 0, F32_DOT=q.dtype == torch.float32 or q.device.type == "cpu",
        **cfg,
    )
    return out


def block_attention(q, k, v, ctx_k, ctx_v, ctx_lens, causal: bool = False, window: int = 0) -> torch.Tensor:
    """The kernel on fresh output memory: [b, nh, Q, hd] contiguous, q's dtype and device."""
    return block_attention_into(torch.empty(q.shape, dtype=q.dtype, device=q.device), q, k, v, ctx_k, ctx_v, ctx_lens,
                                causal, window)
