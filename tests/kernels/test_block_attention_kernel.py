"""The fused OpenAI Triton kernel equals the reference (masks + SDPA) under the interpreter, across the shapes it must serve.

TRITON_INTERPRET=1 runs kernels on CPU tensors; triton reads it when a kernel is decorated, so it is set before the import.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from trtllm_dflash.plugins.block_attention import block_attention as triton_block_attention  # noqa: E402
from trtllm_dflash.plugins.block_attention import launch_config

from trtllm_dflash.kernels.attention import block_attention_reference  # noqa: E402

# (label, b, nh, nkv, Q, hd, C, ctx_lens, causal, window)
CASES = [
    ("empty+one context, b16, GQA 4", 2, 8, 2, 16, 64, 8, [0, 1], False, None),
    ("ragged, non-tile lengths, b8, GQA 3", 3, 9, 3, 8, 64, 150, [0, 63, 150], False, None),
    ("long context, hd128, MHA", 1, 2, 2, 8, 128, 700, [700], False, None),
    ("block 1", 2, 4, 1, 1, 64, 40, [17, 40], False, None),
    ("GQA 8, b16, causal", 2, 16, 2, 16, 64, 90, [5, 90], True, None),
    ("window shorter than context (SWA)", 3, 8, 1, 8, 64, 200, [0, 50, 200], True, 32),
    ("window longer than context", 2, 4, 2, 16, 128, 30, [3, 30], True, 128),
    ("window shorter than the block", 2, 4, 4, 16, 64, 20, [20, 7], True, 5),
    ("bidirectional with a window", 1, 6, 2, 8, 64, 100, [100], False, 40),
]


def make(b, nh, nkv, q, hd, c, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    # q as the draft produces it: a transposed (non-contiguous) view, so strides are exercised.
    return (
        rnd(b, q, nh, hd).transpose(1, 2),
        rnd(b, nkv, q, hd),
        rnd(b, nkv, q, hd),
        rnd(b, nkv, c, hd),
        rnd(b, nkv, c, hd),
        torch.tensor(lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_equals_reference(case):
    """fp32: both sides sum the same products in fp32, only in another order (tiles, online softmax, exp2 for exp):
    a few units of fp32 rounding on outputs of size ~1 -> atol 2e-5 (observed <= 1e-6)."""
    _, b, nh, nkv, q, hd, c, lens, causal, window = case
    args = make(b, nh, nkv, q, hd, c, lens, torch.float32)
    out = triton_block_attention(*args, causal, window or 0)
    ref = block_attention_reference(*args, causal, window)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES[1:2] + CASES[4:6], ids=[c[0] for c in CASES[1:2] + CASES[4:6]])
def test_bf16_within_the_rounding_bound(case):
    """bf16 (8 significant bits: unit roundoff u = 2^-8): the kernel keeps scores, softmax statistics and the accumulator in fp32 and
    rounds twice -- the probabilities to bf16 before P@V (as flash kernels do for tensor cores) and the output.
    Each costs at most u * max|v| resp. u * |out|, so against the exact fp32 result on the same bf16 inputs
    |err| <= u * (|out| + max|v|) (+1e-3 for fp32 noise). The reference's own bf16 result obeys the same bound."""
    _, b, nh, nkv, q, hd, c, lens, causal, window = case
    args = make(b, nh, nkv, q, hd, c, lens, torch.bfloat16, seed=1)
    out = triton_block_attention(*args, causal, window or 0)
    assert out.dtype == torch.bfloat16
    exact = block_attention_reference(*(a.float() if a.is_floating_point() else a for a in args), causal, window)
    v_max = max(args[2].float().abs().max(), args[4].float().abs().max())
    bound = 2.0**-8 * (exact.abs() + v_max) + 1e-3
    assert ((out.float() - exact).abs() <= bound).all()
    ref_bf16 = block_attention_reference(*args, causal, window).float()
    assert ((ref_bf16 - exact).abs() <= bound).all()


SPLIT_CASES = [c for c in CASES if c[6] >= 90]  # contexts of more than one key tile


@pytest.mark.parametrize("splits", [2, 3, 64])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_split_context_merges_to_the_reference(case, splits):
    """Split KV: slices of the context, each with its own max and sum, merged by the second kernel, give the reference
    in fp32 (another summation order again). 64 asks for more slices than key tiles: the launcher caps them, and the
    short rows' later slices see no key at all and must weigh nothing."""
    _, b, nh, nkv, q, hd, c, lens, causal, window = case
    args = make(b, nh, nkv, q, hd, c, lens, torch.float32)
    out = triton_block_attention(*args, causal, window or 0, num_splits=splits)
    torch.testing.assert_close(out, block_attention_reference(*args, causal, window), atol=2e-5, rtol=1e-5)


def test_split_context_in_bf16_within_the_rounding_bound():
    """The slices keep their partial output, max and sum in fp32, so bf16 rounds where the unsplit kernel does."""
    _, b, nh, nkv, q, hd, c, lens, causal, window = CASES[5]
    args = make(b, nh, nkv, q, hd, c, lens, torch.bfloat16, seed=1)
    out = triton_block_attention(*args, causal, window or 0, num_splits=3)
    exact = block_attention_reference(*(a.float() if a.is_floating_point() else a for a in args), causal, window)
    v_max = max(args[2].float().abs().max(), args[4].float().abs().max())
    assert ((out.float() - exact).abs() <= 2.0**-8 * (exact.abs() + v_max) + 1e-3).all()


def test_rows_past_their_length_ignore_the_cache_tail():
    """Garbage (NaN) beyond a row's ctx_len must never reach the output: the kernel stops at each row's length."""
    q, k, v, ck, cv, lens = make(2, 4, 2, 8, 64, 70, [10, 70], torch.float32)
    ck[0, :, 10:], cv[0, :, 10:] = float("nan"), float("nan")
    out = triton_block_attention(q, k, v, ck, cv, lens, False, 0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out[:1],
        block_attention_reference(q[:1], k[:1], v[:1], ck[:1, :, :10], cv[:1, :, :10], lens[:1]),
        atol=2e-5,
        rtol=1e-5,
    )


def test_tiles_respect_tl_dot_minimums():
    """Every tile dimension is a power of two >= 16 (tl.dot's minimum) and the packed query tile stays <= 128 rows."""
    for nh, nkv, q, hd in [(8, 8, 1, 64), (64, 8, 16, 64), (32, 8, 16, 128), (9, 3, 8, 64)]:
        cfg = launch_config(torch.empty(1, nh, q, hd), torch.empty(1, nkv, q, hd))
        assert all(v >= 16 and v & (v - 1) == 0 for v in cfg.values())
        assert cfg["BLOCK_M"] <= 128 and cfg["BLOCK_Q"] >= q and cfg["BLOCK_D"] >= hd
