"""The draft's KV-injected block attention as one fused OpenAI Triton kernel.

One program per (row, KV head, query tile): the tile packs the GROUP query heads that share the KV head
with the row's Q block queries (GROUP x Q <= 8 x 16 = 128 rows), so each key/value tile is read once per
KV head and feeds a real matrix product even though a block has only 1-16 queries. The program streams
the row's own context cache (only [max(0, L-W+1), L) is ever read, L = ctx_lens[row]), then the block's
own K/V, with the visibility rule of `trtllm_dflash.kernels.block_visibility` applied per score and an
online (running max / running sum) softmax in fp32. Ragged batches need no padding work: each row stops
at its own L. The same source runs on CUDA and, under TRITON_INTERPRET=1, on CPU tensors (the tests).

Split KV (FlashDecoding): at batch 1 a draft with 8 KV heads gives the grid 8 programs, each walking the whole
context alone while the GPU's other SMs idle. With `num_splits` > 1 each program takes one slice of the context
(the last slice also the block's own keys) and writes its unnormalised output with its softmax max and sum; a
second kernel merges the slices by rescaling each to the common max, the online softmax's own step.

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
def _online_softmax_step(m_i, l_i, acc, s, vv, F32_DOT: tl.constexpr):
    """One tile of keys into the running max, sum and output (scores `s` in the log2 domain, hidden ones -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(vv.dtype), vv, F32_DOT)


@triton.jit
def _block_attention_kernel(
    Q,
    K,
    V,
    CK,
    CV,
    LENS,
    O,
    PM,
    PL,
    PACC,
    s_qb,
    s_qh,
    s_qt,
    s_qd,
    s_kb,
    s_kh,
    s_kt,
    s_kd,
    s_vb,
    s_vh,
    s_vt,
    s_vd,
    s_ckb,
    s_ckh,
    s_ckt,
    s_ckd,
    s_cvb,
    s_cvh,
    s_cvt,
    s_cvd,
    s_ob,
    s_oh,
    s_ot,
    s_od,
    s_pb,
    s_ph,
    s_pt,
    s_ps,  # PM, PL: [b, nh, Q, splits] fp32 (SPLIT only)
    s_ab,
    s_ah,
    s_at,
    s_as,
    s_ad,  # PACC: [b, nh, Q, splits, hd] fp32 (SPLIT only)
    ctx_cap,
    q_len,
    head_dim,
    window,
    qk_scale,
    num_splits,
    split_len,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    F32_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2) % num_splits  # the context slice [split * split_len, (split + 1) * split_len)
    m = tl.program_id(2) // num_splits * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (head in group, query) index
    g = m // q_len
    t = m % q_len
    m_ok = m < GROUP * q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    head = kvh * GROUP + g

    q = tl.load(
        Q + row * s_qb + head[:, None] * s_qh + t[:, None] * s_qt + d[None, :] * s_qd,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
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
    if SPLIT:
        lo = tl.maximum(lo, split * split_len)
        hi = tl.minimum(hi, (split + 1) * split_len)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        kt = tl.load(
            CK + row * s_ckb + kvh * s_ckh + j[None, :] * s_ckt + d[:, None] * s_ckd,
            mask=j_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = _dot(q, kt, F32_DOT) * qk_scale
        visible = j_ok[None, :]
        if WINDOWED:
            visible = visible & (pos[:, None] - j[None, :] < window)
        vv = tl.load(
            CV + row * s_cvb + kvh * s_cvh + j[:, None] * s_cvt + d[None, :] * s_cvd,
            mask=j_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, tl.where(visible, s, float("-inf")), vv, F32_DOT)

    # The block's own keys (position ctx_len + s): all of them, or s <= t on causal layers; the last slice's.
    if split == num_splits - 1:
        sk = tl.arange(0, BLOCK_Q)
        sk_ok = sk < q_len
        kt = tl.load(
            K + row * s_kb + kvh * s_kh + sk[None, :] * s_kt + d[:, None] * s_kd,
            mask=sk_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = _dot(q, kt, F32_DOT) * qk_scale
        visible = sk_ok[None, :]
        if CAUSAL:
            visible = visible & (sk[None, :] <= t[:, None])
        if WINDOWED:
            visible = visible & (t[:, None] - sk[None, :] < window)
        vv = tl.load(
            V + row * s_vb + kvh * s_vh + sk[:, None] * s_vt + d[None, :] * s_vd,
            mask=sk_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, tl.where(visible, s, float("-inf")), vv, F32_DOT)

    if SPLIT:  # this slice's unnormalised output, max and sum (log2 domain), merged by _merge_kernel
        at = row * s_pb + head * s_ph + t * s_pt + split * s_ps
        tl.store(PM + at, m_i, mask=m_ok)
        tl.store(PL + at, l_i, mask=m_ok)
        tl.store(
            PACC + row * s_ab + head[:, None] * s_ah + t[:, None] * s_at + split * s_as + d[None, :] * s_ad,
            acc,
            mask=m_ok[:, None] & d_ok[None, :],
        )
    else:
        out = acc / l_i[:, None]  # every query sees at least its own key, so l_i > 0 on real rows
        tl.store(
            O + row * s_ob + head[:, None] * s_oh + t[:, None] * s_ot + d[None, :] * s_od,
            out.to(O.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _merge_kernel(
    PM,
    PL,
    PACC,
    O,
    s_pb,
    s_ph,
    s_pt,
    s_ps,
    s_ab,
    s_ah,
    s_at,
    s_as,
    s_ad,
    s_ob,
    s_oh,
    s_ot,
    s_od,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row, head, query): each slice's output rescaled by 2^(its max - the common max), over the rescaled sums.
    A slice that saw no key (max at the -1e30 floor, sum 0) weighs 0; the last slice always saw the query's own key."""
    row, head, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    at = row * s_pb + head * s_ph + t * s_pt + sp * s_ps
    m_s = tl.load(PM + at, mask=sp_ok, other=-1.0e30)
    w = tl.exp2(m_s - tl.max(m_s, 0))
    l_sum = tl.sum(tl.load(PL + at, mask=sp_ok, other=0.0) * w, 0)
    acc = tl.load(
        PACC + row * s_ab + head * s_ah + t * s_at + sp[:, None] * s_as + d[None, :] * s_ad,
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / l_sum
    tl.store(O + row * s_ob + head * s_oh + t * s_ot + d * s_od, out.to(O.dtype.element_ty), mask=d_ok)


def launch_config(q: torch.Tensor, k: torch.Tensor) -> dict:
    """Tile sizes for one call: tl.dot needs every dimension >= 16 and a power of two."""
    group, q_len, head_dim = q.shape[1] // k.shape[1], q.shape[2], q.shape[3]
    return {
        "BLOCK_M": min(128, max(16, triton.next_power_of_2(group * q_len))),
        "BLOCK_N": 64 if head_dim <= 64 else 32,
        "BLOCK_Q": max(16, triton.next_power_of_2(q_len)),
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
    }


def context_splits(q: torch.Tensor, k: torch.Tensor, ctx_k: torch.Tensor, window: int, cfg: dict) -> int:
    """FlashDecoding's rule: split the context only while the grid has fewer programs than about two per SM, and keep
    each slice at least 256 keys (a slice's fixed cost: its query tile, its partial results). A windowed layer reads
    at most its window, wherever it lies, so it is not split. On a CPU: 1."""
    if q.device.type != "cuda" or window > 0:
        return 1
    programs = q.shape[0] * k.shape[1] * triton.cdiv((q.shape[1] // k.shape[1]) * q.shape[2], cfg["BLOCK_M"])
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(triton.cdiv(ctx_k.shape[2], 256), triton.cdiv(2 * sms, programs), 64))


def block_attention_into(
    out: torch.Tensor, q, k, v, ctx_k, ctx_v, ctx_lens, causal: bool, window: int, num_splits: int | None = None
) -> torch.Tensor:
    """Launch the kernel writing `out` [b, nh, Q, hd] (any strides); window <= 0 means no window; `num_splits`
    slices of the context (None: `context_splits`), merged by a second kernel when more than one.

    Shapes are the op's (checked by `trtllm_dflash.kernels.attention.block_attention`); the TensorRT plugin calls this
    with tensors viewed over TensorRT's buffers, the torch op with a fresh output.
    """
    b, nh, q_len, hd = q.shape
    nkv = k.shape[1]
    cfg = launch_config(q, k)
    cap = ctx_k.shape[2]
    splits = context_splits(q, k, ctx_k, int(window), cfg) if num_splits is None else max(1, int(num_splits))
    split_len = triton.cdiv(triton.cdiv(max(cap, 1), splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]  # whole key tiles
    splits = max(1, triton.cdiv(cap, split_len))  # no slice wholly past the cache
    if splits > 1:
        pm = torch.empty(b, nh, q_len, splits, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(b, nh, q_len, splits, hd, dtype=torch.float32, device=q.device)
    else:  # unused: SPLIT is off
        pm = pl = pacc = out
    p_strides = pm.stride() if splits > 1 else (0, 0, 0, 0)
    a_strides = pacc.stride() if splits > 1 else (0, 0, 0, 0, 0)
    grid = (b, nkv, triton.cdiv((nh // nkv) * q_len, cfg["BLOCK_M"]) * splits)
    _block_attention_kernel[grid](
        q,
        k,
        v,
        ctx_k,
        ctx_v,
        ctx_lens,
        out,
        pm,
        pl,
        pacc,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *ctx_k.stride(),
        *ctx_v.stride(),
        *out.stride(),
        *p_strides,
        *a_strides,
        cap,
        q_len,
        hd,
        max(int(window), 0),
        LOG2E / math.sqrt(hd),
        splits,
        split_len,
        GROUP=nh // nkv,
        CAUSAL=bool(causal),
        WINDOWED=int(window) > 0,
        F32_DOT=q.dtype == torch.float32 or q.device.type == "cpu",
        SPLIT=splits > 1,
        **cfg,
    )
    if splits > 1:
        _merge_kernel[(b, nh, q_len)](
            pm,
            pl,
            pacc,
            out,
            *p_strides,
            *a_strides,
            *out.stride(),
            splits,
            hd,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=cfg["BLOCK_D"],
        )
    return out


def block_attention(
    q, k, v, ctx_k, ctx_v, ctx_lens, causal: bool = False, window: int = 0, num_splits: int | None = None
) -> torch.Tensor:
    """The kernel on fresh output memory: [b, nh, Q, hd] contiguous, q's dtype and device."""
    return block_attention_into(
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        q,
        k,
        v,
        ctx_k,
        ctx_v,
        ctx_lens,
        causal,
        window,
        num_splits,
    )
