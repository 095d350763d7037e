"""Prepacked linears (kernels/packed.py): the target decodes exactly as stock Hugging Face does, and faster."""

import statistics
import time

import pytest
import torch
from test_lossless import MAX_NEW, PROMPTS
from torch import nn

from trtllm_dflash.cpu import cpu_flags
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.packed import PackedLinear, can_pack, pack_linears, packs
from trtllm_dflash.models.target import TargetModel


@pytest.fixture(scope="module")
def stock(target_dir):
    return TargetModel.load(target_dir, pack=False)


def test_packed_target_greedy_equals_stock_hf_generate(target, stock):
    """fp32 greedy output of the packed target (the runtime's) equals unmodified transformers' generate()."""
    assert any(isinstance(m, PackedLinear) for m in target.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in stock.model.modules())
    engine = DFlashEngine(target, None, 1)
    for prompt, chat in PROMPTS:
        ids = torch.tensor([engine.encode(prompt, chat)])
        kw = dict(
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=target.tokenizer.pad_token_id,
        )
        assert target.model.generate(ids, **kw).tolist() == stock.model.generate(ids, **kw).tolist(), prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_projection_does_not_depend_on_the_rows_beside_it(dtype):
    """A token verified inside a block gets the same projection as inside any other block, bit for bit, and alone
    too, except where one bf16 token takes ATen's faster kernel: then it may differ by bf16 rounding. Where AMX's
    tiles take calls of more than `TILE_ROWS` rows, the first such call makes their copy of the weight, and a row of
    it is within bf16 rounding of it alone."""
    lin = nn.Linear(576, 1536, bias=True).to(dtype)
    packed = PackedLinear(lin)
    x = torch.randn(3, 8, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        block = packed(x[1:2])  # a batch-1 verify of 8 tokens
        assert torch.equal(packed(x[1:2, 3:5]), block[:, 3:5])
        alone = packed(x[1:2, 3:4])
        if packed.one_token_dense:
            assert dtype == torch.bfloat16
            torch.testing.assert_close(alone, block[:, 3:4], rtol=2**-7, atol=0)  # one bf16 ulp
        else:
            assert torch.equal(alone, block[:, 3:4])
        full = packed(x)  # three blocks in one call
        assert torch.equal(full[1:2], block)
        torch.testing.assert_close(full, lin(x), rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)
        if packed.kernel is not None and packed.tiled:
            assert dtype == torch.bfloat16 and packed.tiles is None
            many = torch.cat([x.view(-1, 576)] * 3)[: bf16_gemm.TILE_ROWS + 1]
            tiled = packed(many)
            assert packed.tiles is not None
            torch.testing.assert_close(tiled[8:16], block[0], rtol=2**-7, atol=1e-3)


def test_packing_keeps_the_lm_head_weight_and_drops_the_others():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    n = pack_linears(model, keep=(model[2],))
    assert n == 2 and model[0].weight is None and model[2].weight is not None
    assert not any(p.shape == (16, 8) for p in model.parameters())  # the dense copy is gone


def test_verify_of_a_block_costs_little_more_than_a_decode_step(target, stock, one_thread):
    """The point of packing: with the dense BLAS path, 8 tokens cost far more than 1 (the weights are repacked every
    call); packed, much less. Compared side by side on one thread, the four forwards taking turns, so that a burst of
    noise (one CI run measured 2.00 against 1.58 with the four one after the other) meets all of
    them alike."""
    ids = torch.randint(100, 1000, (1, 136), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, tm in (("packed", target), ("stock", stock)):
        caches[name] = tm.new_cache(1, 160)
        tm.forward(ids[:, :128], 0, caches[name], capture=False, logits_to_keep=1)
    times = {(name, t): [] for name in caches for t in (1, 8)}
    for _ in range(9):
        for name, tm in (("packed", target), ("stock", stock)):
            for t in (1, 8):
                t0 = time.perf_counter()
                tm.forward(ids[:, 128 : 128 + t], 128, caches[name], capture=False)
                times[name, t].append(time.perf_counter() - t0)
    cost = {key: statistics.median(ts) for key, ts in times.items()}
    packed_ratio = cost["packed", 8] / cost["packed", 1]
    stock_ratio = cost["stock", 8] / cost["stock", 1]
    assert packed_ratio < stock_ratio, (packed_ratio, stock_ratio)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_draft_computes_what_the_draft_does(dtype):
    """Packing fuses each draft layer's q/k/v and gate/up into one GEMM and stacks the context K/V projection: the
    real draft's context K/V and ragged block hidden states stay the unpacked draft's (fp32: oneDNN rounding only;
    bf16, where our kernels run: their norms and block attention, within two bf16 roundings of the largest value),
    and a packed draft refuses to train."""
    from trtllm_dflash.models.checkpoint import load_draft
    from trtllm_dflash.resolve import resolve_draft

    path = resolve_draft(None, "smollm2-135m")
    plain, packed = load_draft(path, dtype), load_draft(path, dtype)
    packed.pack()
    assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None for layer in packed.layers)
    assert (packed._kernel is not None) == (dtype == torch.bfloat16 and bf16_gemm.kernel() is not None)
    c, g = plain.config, torch.Generator().manual_seed(0)
    feats = torch.randn(3, 40, plain.fc.in_features, generator=g).to(dtype)
    lens = torch.tensor([40, 13, 0])
    x = torch.randn(3, c.block_size, c.hidden_size, generator=g).to(dtype)
    with torch.inference_mode():
        out = []
        for model in (plain, packed):
            k, v = model.context_kv(model.project_context(feats), torch.arange(40).expand(3, -1))
            out.append((k, v, model.draft_block(x, lens[:, None] + torch.arange(c.block_size), k, v, lens)))
    for want, got in zip(*out):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-6
    with pytest.raises(DFlashError, match="inference only"):
        packed.train()


needs_kernel = pytest.mark.skipif(bf16_gemm.variant() is None, reason="needs a CPU with AVX-512 BF16, or AVX2 alone")
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # torch as on a CPU with AVX2 alone
ISA_ENV = {"native": None, "avx2": AVX2, "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}  # avx512: AMX held off

BATCH_INVARIANCE = """
import sys, torch
from torch import nn
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.packed import PackedLinear
bias = sys.argv[1] == "True"
g = torch.Generator().manual_seed(0)
for k, n in ((1536, 576), (100, 64)):  # the second: a block's weights not a whole number of the AVX2 kernel's chunks
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.kernel is not None and packed.weight is None
    ours = lambda x: packed.kernel.linear(x, packed.packed, packed.kernel_bias)
    x = (torch.randn(40, k, generator=g) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        full = ours(x)
        exact = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33):
            assert torch.equal(ours(x[:m]), full[:m]), m
        assert all(torch.equal(ours(x[i : i + 1]), full[i : i + 1]) for i in range(40))
        assert torch.equal(ours(x[5:21].view(2, 8, k)), full[5:21].view(2, 8, n))
        assert (full.double() - exact).abs().max() <= (exact.abs() * 2**-8).max() + 1e-6
        torch.testing.assert_close(full, lin(x), rtol=2**-7, atol=1e-2)
        rows = bf16_gemm.TILE_ROWS if bf16_gemm.tiles() else 40  # the layer's calls our kernel takes (more: AMX's tiles)
        assert torch.equal(packed(x[:rows]), full[:rows]) and torch.equal(packed(x[3:4]), full[3:4])
        torch.testing.assert_close(packed(x), full, rtol=2**-7, atol=1e-2)
print(bf16_gemm.variant())
"""


def _in_child(code: str, *args: str, env: dict | None = None) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=os.environ | (env or {}), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


def _kernel_child(code: str, isa: str, *args: str) -> None:
    """Run a kernel check in a child: torch as on this CPU ("native") or as on one with AVX2 alone ("avx2"); the
    child prints the kernel variant it ran, which must be the one expected there."""
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs AVX2 and FMA")
    if isa == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU has AVX2 alone: the native run is the AVX2 one")
    if isa == "avx512" and bf16_gemm.variant() != "amx":
        pytest.skip("needs AMX: elsewhere the AVX-512 variant is the native run, or cannot run")
    want = bf16_gemm.variant() if isa == "native" else isa
    assert _in_child(code, *args, env=ISA_ENV[isa]) == want


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("isa", ["native", "avx2", "avx512"])
def test_bf16_kernel_rows_are_batch_invariant_and_round_as_the_library(bias, isa):
    """bf16 linears take our kernel: on a CPU with AVX-512 BF16 the native one (bf16_gemm.cpp; with AMX on its
    tiles, and on a CPU with AMX also held off them as on a Zen 4), where torch runs on AVX2 alone the FMA one
    (bf16_gemm_avx2.cpp; emulated here with ATEN_CPU_CAPABILITY=avx2, the instructions are the real ones). Each
    row's output is bit for bit the same alone, in any slice and in a batch of any size (1-40 rows: whole passes and
    ragged last ones), and within one bf16 rounding of the exact product, as F.linear's is."""
    _kernel_child(BATCH_INVARIANCE, isa, str(bias))


INT8 = """
import torch
from torch import nn
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.packed import PackedLinear
g = torch.Generator().manual_seed(3)
for k, n, bias in ((1536, 576, False), (100, 64, True), (576, 16384, False)):  # 100: not a whole number of chunks
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin, int8=True)
    assert packed.scale is not None and packed.packed.dtype == torch.int8 and packed.weight is None
    q = bf16_gemm.unpack_int8(packed.packed, packed.scale)  # what the kernel multiplies: each weight within half a step
    assert ((q - lin.weight.float()).abs() <= packed.scale[:, None] / 2 * (1 + 1e-6)).all()
    x = (torch.randn(40, k, generator=g) * 2).to(torch.bfloat16)
    with torch.inference_mode():
        full = packed(x)
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33):
            assert torch.equal(packed(x[:m]), full[:m]), m
        assert all(torch.equal(packed(x[i : i + 1]), full[i : i + 1]) for i in range(40))
        exact = x.double() @ q.double().t() + (lin.bias.double() if bias else 0)
        assert (full.double() - exact).abs().max() <= (exact.abs() * 2**-8).max() + 1e-5  # one bf16 rounding
        ref = lin(x).float()
        assert (full.float() - ref).norm() <= 0.01 * ref.norm()  # and close to the bf16 weights' product
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_int8_weights_where_the_kernel_takes_them_are_row_invariant_and_within_rounding(isa):
    """Where torch runs on AVX2 alone, a linear packed with `int8=True` keeps int8 weights, one scale per output, each
    within half a step of the bf16 weight; its rows come out alone as in any batch, within one bf16 rounding of the
    exact product with the int8 weights. Elsewhere (AVX-512, AMX) `int8` changes nothing."""
    if isa == "avx2":
        _kernel_child(INT8, isa)
    else:
        assert bf16_gemm.int8_weights() == (bf16_gemm.variant() == "avx2")
        packed = PackedLinear(nn.Linear(64, 64).to(torch.bfloat16), int8=True)
        assert (packed.scale is not None) == bf16_gemm.int8_weights()


INT8_DRAFT = """
import torch
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.kernels.packed import PackedLinear
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.engine.request import GenerationStats
engine = DFlashEngine.load("smollm2-135m", dtype="bf16", speculation="fixed", progress=lambda m: None)
plain = DFlashEngine(engine.target, None, 1)
linears = [m for m in engine.draft.modules() if isinstance(m, PackedLinear)] + [engine.draft._vocab[1]]
assert len(linears) == 1 + 3 * 4 + 2 and all(m.scale is not None for m in linears)  # fc, ctx K/V, 4 a layer, the head
accepted = 0
for text in ("What are three simple habits that help people sleep better?", "Write a Python function that reverses a string."):
    ids = engine.encode(text)
    stats = GenerationStats()
    got = [t for step, _ in engine.stream(ids, max_new_tokens=48, stats=stats) for t in step]
    want = [t for step, _ in plain.stream(ids, max_new_tokens=48) for t in step]
    assert got == want, text
    accepted += stats.accepted_tokens
assert accepted > 10
print(bf16_gemm.variant())
"""


@needs_kernel
def test_a_bf16_engine_on_avx2_drafts_with_int8_weights_and_writes_what_plain_decoding_writes():
    """On a CPU with AVX2 alone (emulated here unless this is one), `DFlashEngine.load` keeps the draft's linears and its
    vocabulary head as int8 weights; the guesses change a little, the output not at all: bf16 DFlash with the shipped
    draft writes token for token what bf16 plain decoding writes, and the int8 draft's guesses are accepted."""
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert _in_child(INT8_DRAFT) == "avx2"
    else:
        _kernel_child(INT8_DRAFT, "avx2")


STEP_ATTENTION = """
import torch
from trtllm_dflash.kernels import bf16_gemm
attend = bf16_gemm.kernel().attend
g = torch.Generator().manual_seed(0)
for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128), (14, 2, 64), (8, 8, 256), (16, 2, 128)):
    k, v = (torch.randn(3, kv_heads, 300, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    q = (torch.randn(20, heads, head_dim, generator=g) * 2).to(torch.bfloat16)
    slot = torch.tensor([0] * 8 + [2] * 11 + [1])  # a verify block, a longer ragged row, a decode step
    pos = torch.cat([torch.arange(120, 128), torch.arange(289, 300), torch.tensor([0])])
    out = attend(q, k, v, slot, pos, head_dim**-0.5)
    for t in range(20):  # every token alone: the same bits, and softmax attention over its slot up to its position
        assert torch.equal(attend(q[t : t + 1], k, v, slot[t : t + 1], pos[t : t + 1], head_dim**-0.5), out[t : t + 1])
        keys, values = (c[slot[t], :, : pos[t] + 1].double().repeat_interleave(heads // kv_heads, 0) for c in (k, v))
        exact = ((q[t].double()[:, None] @ keys.transpose(1, 2)) * head_dim**-0.5).softmax(-1) @ values  # [H, 1, D]
        assert (out[t].double() - exact[:, 0]).abs().max() <= exact.abs().max() * 2**-8 + 1e-6, (heads, head_dim, t)
try:
    attend(q[:1], k, v, slot[:1], torch.tensor([300]), 0.1)
except RuntimeError as e:
    assert "outside the cache" in str(e)
else:
    raise AssertionError("a position past the cache was read")
print(bf16_gemm.variant())
"""


ROPE_ATTEND = """
import torch
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.target import _rotate_half
kernel = bf16_gemm.kernel()
g = torch.Generator().manual_seed(1)
H, KVH, D, N = 9, 3, 64, 12
qkv = (torch.randn(N, (H + 2 * KVH) * D, generator=g) * 3).to(torch.bfloat16)  # the fused projection's output
q, k, v = (t.view(N, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))  # strided views, as the model's
slot = torch.tensor([1] * 8 + [0] * 3 + [2])
pos = torch.cat([torch.arange(40, 48), torch.arange(7, 10), torch.tensor([0])])
inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
emb = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)
cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)  # [N, D], as HF's rotary embedding gives them
kc, vc = (torch.randn(3, KVH, 64, D, generator=g).to(torch.bfloat16) for _ in range(2))
want_k, want_v = kc.clone(), vc.clone()
rot = lambda x: x * cos[:, None] + _rotate_half(x) * sin[:, None]  # the unfused ops, in bf16
want_k[slot, :, pos], want_v[slot, :, pos] = rot(k), v
want = kernel.attend(rot(q), want_k, want_v, slot, pos, D**-0.5).view(N, H * D)
got = kernel.rope_attend(q, k, v, cos, sin, kc, vc, slot, pos, D**-0.5)
assert torch.equal(got, want) and torch.equal(kc, want_k) and torch.equal(vc, want_v)
print(bf16_gemm.variant())
"""


RMS_NORM = """
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from trtllm_dflash.kernels import bf16_gemm
kernel = bf16_gemm.kernel()
g = torch.Generator().manual_seed(2)
norm = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
norm.weight.data = (1 + torch.randn(576, generator=g) * 0.3).to(torch.bfloat16)
x = (torch.randn(2, 37, 576, generator=g) * 4).to(torch.bfloat16)
got, want = kernel.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x)
assert got.shape == want.shape and got.dtype == torch.bfloat16
assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7).all()  # within one bf16 rounding of HF's
assert (got == want).float().mean() > 0.99  # the same bits but where the sum's order tips a rounding
assert all(torch.equal(kernel.rms_norm(x[1, i], norm.weight, 1e-5), got[1, i]) for i in range(37))  # alone as in the batch
heads = (torch.randn(2, 5, 12, 64, generator=g) * 4).to(torch.bfloat16)  # a weight per head (the draft's q/k norms)
w = (1 + torch.randn(12, 64, generator=g) * 0.3).to(torch.bfloat16)
grouped = kernel.rms_norm(heads, w, 1e-6)
assert all(torch.equal(grouped[..., h, :], kernel.rms_norm(heads[..., h, :], w[h], 1e-6)) for h in range(12))
print(bf16_gemm.variant())
"""


BLOCK_ATTEND = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trtllm_dflash.kernels import attention
from trtllm_dflash.kernels import bf16_gemm
kernel = bf16_gemm.kernel()

class OpCalls(TorchDispatchMode):
    calls = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.trtdflash.block_attention.default
        return func(*args, **(kwargs or {}))

g = torch.Generator().manual_seed(3)
lens = torch.tensor([0, 17, 40])
for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128), (6, 2, 64), (8, 8, 256)):
    qkv = (torch.randn(3, 8, heads + 2 * kv_heads, head_dim, generator=g) * 2).to(torch.bfloat16)  # the draft's fused QKV
    q, k, v = (t.transpose(1, 2) for t in qkv.split([heads, kv_heads, kv_heads], dim=2))  # strided views, as the draft's
    cache = torch.randn(2, 4, kv_heads, 64, head_dim, generator=g).to(torch.bfloat16)  # [K/V, slots, KVH, capacity, D]
    ck, cv = cache[0, 1:, :, :40], cache[1, 1:, :, :40]  # three slots' first 40 positions, read in place
    for causal in (False, True):
        with OpCalls() as seen:
            out = attention.block_attention(q, k, v, ck, cv, lens, causal)
        assert seen.calls == 0 and torch.equal(out, kernel.block_attend(q, k, v, ck, cv, lens, causal, head_dim**-0.5))
        exact = attention.block_attention_reference(*(t.double() for t in (q, k, v, ck, cv)), lens, causal)
        assert out.shape == exact.shape and (out.double() - exact).abs().max() <= exact.abs().max() * 2**-8 + 1e-6, (heads, causal)
        for i in range(3):  # a row alone gives the same bits as beside the others
            alone = attention.block_attention(q[i:i+1], k[i:i+1], v[i:i+1], ck[i:i+1], cv[i:i+1], lens[i:i+1], causal)
            assert torch.equal(alone, out[i:i+1]), (heads, causal, i)
with OpCalls() as seen:  # a sliding window is the op's (the reference on CPU)
    windowed = attention.block_attention(q, k, v, ck, cv, lens, False, 5)
assert seen.calls == 1 and torch.equal(windowed, attention.block_attention_reference(q, k, v, ck, cv, lens, False, 5))
try:
    kernel.block_attend(q, k, v, ck, cv, torch.tensor([0, 17, 41]), False, 0.1)
except RuntimeError as e:
    assert "outside [0, 40]" in str(e)
else:
    raise AssertionError("a context past the cache was read")
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_rms_norm_kernel_is_the_hf_module_and_batch_invariant(isa):
    """bf16 targets' RMSNorm in one call (rms_norm.h) against Hugging Face's LlamaRMSNorm (Qwen2's and Qwen3's are the
    same code): within one bf16 rounding everywhere and the same bits almost everywhere; a row alone as in a batch."""
    _kernel_child(RMS_NORM, isa)


SILU_MUL = """
import torch
import torch.nn.functional as F
from trtllm_dflash.kernels import bf16_gemm
kernel = bf16_gemm.kernel()
g = torch.Generator().manual_seed(5)
gate_up = (torch.randn(2, 20, 2 * 1536, generator=g) * 4).to(torch.bfloat16)  # the fused gate/up projection's output
gate, up = gate_up.split([1536, 1536], dim=-1)
got, want = kernel.silu_mul(gate_up), F.silu(gate) * up
assert got.shape == want.shape and got.dtype == torch.bfloat16
assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7 + 1e-30).all()  # within one bf16 rounding
assert (got == want).float().mean() > 0.999  # the same bits but where silu's last fp32 bit tips a rounding
assert all(torch.equal(kernel.silu_mul(gate_up[1, i]), got[1, i]) for i in range(20))  # alone as in the batch
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_silu_mul_kernel_is_torchs_activation_and_row_invariant(isa):
    """The gated MLP's silu(gate) * up in one call (activation.h) on both variants: torch's bf16 result within one
    rounding everywhere and the same bits almost everywhere; a row alone as in a batch."""
    _kernel_child(SILU_MUL, isa)


ARGMAX = """
import torch
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.engine.sampling import greedy
kernel = bf16_gemm.kernel()
g = torch.Generator().manual_seed(4)
for V in (49152, 16384, 37, 16, 1):
    x = torch.randn(9, V, generator=g).to(torch.bfloat16)
    x[1, V // 2 :] = x[1].max()  # a tie: the first one wins
    x[2] = -float("inf")
    x[3, V // 3] = x[3, -1] = float("nan")  # NaN is the maximum, as in torch
    x[4, -1] = float("nan")
    x[5] = float("inf")
    x[6] = 0.0
    x[6, ::2] = -0.0  # zeros of both signs are equal
    for view in (x, x.view(3, 3, V), x[::2], x[:, : max(1, V - 3)]):  # batched, strided and ragged-tail rows
        assert torch.equal(kernel.argmax(view), view.argmax(-1)), V
        assert torch.equal(greedy(view), view.argmax(-1))
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_greedy_argmax_kernel_is_torch_argmax(isa):
    """Greedy decoding's bf16 argmax (argmax.h, through `sampling.greedy`) is torch.argmax exactly on both variants:
    ties, NaN, infinities, signed zeros, row lengths that are and are not whole vectors, strided views."""
    _kernel_child(ARGMAX, isa)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_draft_block_attention_kernel_is_softmax_attention_and_row_invariant(isa):
    """The draft's block attention in bf16 on CPU takes our kernel (`block_attend`, called directly, not through the
    op): for SmolLM2's, Qwen3's and odd head layouts, bidirectional and causal blocks, ragged contexts (0, 17 and all
    40 positions) read in place from a larger cache: softmax attention within one bf16 rounding, each row alone the
    same bits as in the batch; a sliding window still goes to the op, and a context past the cache is refused."""
    _kernel_child(BLOCK_ATTEND, isa)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_fused_step_attention_is_the_unfused_ops_bit_for_bit(isa):
    """`rope_attend` (RoPE, the cache writes and attention in one call, as a bf16 step runs them) gives the same bits
    as the ops it replaced: torch's bf16 RoPE on the projection's strided views, the K/V written at each token's slot
    and position (a verify block, a ragged row, a first token), then `attend`."""
    _kernel_child(ROPE_ATTEND, isa)


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_step_attention_kernel_is_softmax_attention_and_batch_invariant(isa):
    """A bf16 step's attention (slot_attention.h) on both variants, for the head layouts of SmolLM2, Qwen3, odd head
    groups and a 256 head dim: each token's output is softmax attention over its slot up to its position within one
    bf16 rounding, and bit for bit the same alone as beside a verify block, a ragged row and a decode step."""
    _kernel_child(STEP_ATTENTION, isa)


DECODER_STEP = """
import torch
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import resolve_target
target = TargetModel.load(resolve_target("smollm2-135m", lambda m: None), torch.bfloat16)
target.set_taps([1, 14, 27])
cache = target.new_cache(4, 128)
g = torch.Generator().manual_seed(3)
starts = [40, 57, 33, 80]
with torch.inference_mode():
    for slot, n in enumerate(starts):  # prompts prefilled through the layer loop (more tokens than a step)
        target.forward(torch.randint(100, 1000, (1, n), generator=g), 0, cache, capture=False, logits_to_keep=1, first_slot=slot)
    fused = target._fused
    assert fused[0] is not None and len(fused[0]) == 30
    for rows in ([[5]], [list(range(5, 13))], [[5, 6], [7], [8, 9, 10, 11], [12, 13, 14]], [[5]] * 4):
        got = target.forward_rows(rows, starts[: len(rows)], cache, capture=True)
        target._fused = (None, 0)  # the same step through the layer loop's calls, one by one
        want = target.forward_rows(rows, starts[: len(rows)], cache, capture=True)
        target._fused = fused
        assert all(torch.equal(a, b) for a, b in zip(got, want)), [len(r) for r in rows]
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2", "avx512"])
def test_a_steps_layers_in_one_kernel_call_each_are_the_layer_loop_bit_for_bit(isa):
    """A bf16 step runs each decoder layer of the real target as one call of our kernel (decoder_layer.h), with the
    same logits and tapped features, bit for bit, as the layer loop's calls one by one: a decode step, a verify block,
    ragged rows and a batch of decode steps, on every variant."""
    _kernel_child(DECODER_STEP, isa)


GIL_FREE = """
import threading, time, torch
from trtllm_dflash.kernels import bf16_gemm
kernel = bf16_gemm.kernel()
torch.set_num_threads(1)
w = kernel.pack(torch.randn(4096, 8192).to(torch.bfloat16))  # long enough a call (10 ms and more) on every variant
x = torch.randn(256, 8192).to(torch.bfloat16)
k, v = (torch.randn(1, 4, 4096, 128).to(torch.bfloat16) for _ in range(2))
q, slot, pos = torch.randn(256, 16, 128).to(torch.bfloat16), torch.zeros(256, dtype=torch.long), torch.arange(3840, 4096)
for name, call in (("linear", lambda: kernel.linear(x, w, None)), ("attend", lambda: kernel.attend(q, k, v, slot, pos, 0.1))):
    tries = []
    for _ in range(3):  # a call that keeps the GIL holds the spinner up every time; a host's stolen time, once
        done, ticks = threading.Event(), [time.perf_counter()]
        worker = threading.Thread(target=lambda: (call(), done.set()))
        worker.start()
        while not done.is_set():  # this thread keeps running Python while the call runs in the other
            ticks.append(time.perf_counter())
        worker.join()
        took, longest = ticks[-1] - ticks[0], max(b - a for a, b in zip(ticks, ticks[1:]))
        tries.append((round(took, 4), round(longest, 4)))
        if took > 0.01 and longest < took / 2:
            break
    else:
        raise AssertionError((name, "(call seconds, longest hold-up) per try", tries))
print(bf16_gemm.variant())
"""


@needs_kernel
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_kernel_calls_release_the_gil(isa):
    """A server's request threads run Python (their responses) while the engine thread's forward is in our kernels: a
    thread spinning beside a long linear or attention call is never held up for most of it, as it is when the call
    keeps the GIL."""
    _kernel_child(GIL_FREE, isa)


@needs_kernel
def test_bf16_kernel_leaves_unfit_shapes_and_fp32_to_the_library():
    """A weight whose out_features is not a multiple of 32, and every fp32 weight, keep the library's kernels: oneDNN's
    packed one, or for bf16 where oneDNN packs none (a CPU with AVX2 alone) ATen's, which still computes the layer."""
    unfit = nn.Linear(64, 48).to(torch.bfloat16)
    packed = PackedLinear(unfit)
    assert packed.kernel is None and packs(unfit.weight) == can_pack(torch.bfloat16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), unfit(x), rtol=2**-7, atol=1e-2)
    assert PackedLinear(nn.Linear(64, 64)).kernel is None
    assert PackedLinear(nn.Linear(64, 64).to(torch.bfloat16)).kernel is not None


def test_a_bf16_drafts_vocabulary_head_takes_a_packed_kernel_wherever_one_runs():
    """The draft vocabulary's head (rows of the target's LM head) is packed as the other linears are: on a CPU with AVX2
    alone ATen's emulated bf16 kernel took 13.2 ms for a block's 7 guesses over 16,384 rows, ours 3.0 (AMD EPYC Zen 3,
    2026-11-28)."""
    draft = DFlashEngine.load("smollm2-135m", dtype="bf16", progress=lambda m: None).draft
    ids, head, _ = draft._vocab
    assert isinstance(head, PackedLinear) == packs(torch.empty(len(ids), head.in_features, dtype=torch.bfloat16))
    if bf16_gemm.kernel() is not None:  # the shipped vocabulary's rows fit ours
        assert head.kernel is not None


@needs_kernel
def test_bf16_kernel_that_cannot_be_built_falls_back_with_one_sentence(tmp_path):
    """No working compiler: the build it tried and why it failed, one line each on stderr, and bf16 linears still run
    (the library's kernels)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch; from torch import nn; from trtllm_dflash.kernels.packed import PackedLinear; "
        "p = PackedLinear(nn.Linear(64, 64).to(torch.bfloat16)); "
        "print(p.kernel is None, tuple(p(torch.ones(3, 64, dtype=torch.bfloat16)).shape))"
    )
    env = os.environ | {"TRTDFLASH_CACHE": str(tmp_path), "CXX": "/bin/false"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "(3,", "64)"]
    lines = [line for line in done.stderr.splitlines() if "bf16 matrix kernel" in line]
    assert len(lines) == 2 and "building" in lines[0] and lines[1].endswith("using the library's."), done.stderr
