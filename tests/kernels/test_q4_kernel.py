"""4-bit weights multiplied as shipped (kernels/q4_blocks.h, models/gguf4.py): on the real SmolLM2 GGUF, each variant's
rows equal its bf16 kernel's on the dequantized weights bit for bit at any number of rows, those weights are the ones
the dense path loads, and the engine on them writes what it writes on bf16 weights, DFlash and plain alike."""

import os
import subprocess
import sys
import threading

import pytest
import torch
from test_lossless import MAX_NEW, PROMPTS

from trtllm_dflash.cpu import cpu_flags
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.gguf4 import GGUF_FILE, Q4_0, Q4_1, codes_of, dequantized, read_codes

ISA_ENV = {  # torch as on a CPU with AVX2 alone; an AMX CPU held off its tiles, as one with AVX-512 BF16 alone
    "native": None,
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}

ROWS = """
import sys, torch
from pathlib import Path
from trtllm_dflash.kernels import bf16_gemm
from trtllm_dflash.models.gguf4 import dequantized, read_codes
codes = read_codes(Path(sys.argv[1]))
kernel = bf16_gemm.kernel()
g = torch.Generator().manual_seed(0)
names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
         "model.layers.7.mlp.down_proj.weight", "model.layers.29.mlp.up_proj.weight"]
for name in names:
    c = codes[name]
    n, k = c.q.shape
    records, packed = bf16_gemm.pack_q4(c), kernel.pack(dequantized(c))
    bias = torch.randn(n, generator=g)
    x = (torch.randn(40, k, generator=g) * 2).to(torch.bfloat16)
    for b in (None, bias):
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 33):
            assert torch.equal(kernel.linear_q4(x[:m], records, b), kernel.linear(x[:m], packed, b)), (name, m)
        full = kernel.linear_q4(x, records, b)
        assert all(torch.equal(kernel.linear_q4(x[i : i + 1], records, b), full[i : i + 1]) for i in range(40))
print(bf16_gemm.variant())
"""


def _child(env: dict | None, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", ROWS, *args], env=os.environ | (env or {}), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.mark.parametrize("isa", ["native", "avx2", "avx512"])
def test_each_variants_4bit_rows_equal_its_bf16_kernels_on_the_dequantized_weights(target_dir, isa):
    """The AVX-512 BF16 variant (VDPBF16PS) natively or on an AMX CPU held off its tiles, the AVX2 one (FMA) where
    torch runs as on a CPU with AVX2 alone:
    linear_q4 on a GGUF's Q4_1 tensors gives the bits `linear` gives on bf16(d * q + m), alone, in any slice and with
    a bias, 1-40 rows (whole passes of rows and of blocks, and ragged ones)."""
    variant = bf16_gemm.variant()
    if isa == "native" and variant not in ("avx512", "avx2"):
        pytest.skip("natively this CPU runs no variant whose 4-bit rows match its bf16 ones (AMX's tiles sum apart)")
    if isa == "avx2" and (not {"avx2", "fma", "f16c"} <= cpu_flags() or variant == "avx2"):
        pytest.skip("needs AVX2, FMA and F16C, on a CPU whose native run is not the AVX2 one already")
    if isa == "avx512" and variant != "amx":
        pytest.skip("needs AMX: elsewhere the AVX-512 variant is the native run, or cannot run")
    assert _child(ISA_ENV[isa], str(target_dir / GGUF_FILE)) == (variant if isa == "native" else isa)


def test_4bit_codes_dequantize_as_the_gguf_conversion_does_and_as_the_dense_path_loads(target_dir):
    """Every Q4_1 tensor of the shipped GGUF (rows in Hugging Face order, a llama q/k projection's un-interleaved):
    bf16(d * q + m) is the bf16 weight the dense path loads from the converted safetensors; and a Q4_0 tensor, written
    by gguf-py's own quantizer, reads as the same values gguf-py's dequantizer gives."""
    import gguf
    from safetensors.torch import load_file

    codes = read_codes(target_dir / GGUF_FILE)
    dense = load_file(target_dir / "model.safetensors")
    assert len(codes) == 30 * 7  # q, k, v, o, gate, up, down of every layer; the embeddings are Q8_0: dense
    for name, c in codes.items():
        assert torch.equal(dequantized(c), dense[name].to(torch.bfloat16)), name
    w = dense["model.layers.3.mlp.gate_proj.weight"].numpy()
    for kind in (Q4_0, Q4_1):
        raw = gguf.quantize(w, gguf.GGMLQuantizationType(kind))
        want = gguf.dequantize(raw, gguf.GGMLQuantizationType(kind)).reshape(w.shape)
        assert torch.equal(dequantized(codes_of(kind, raw, w.shape)), torch.from_numpy(want).to(torch.bfloat16))


@pytest.mark.skipif(not bf16_gemm.q4_weights(), reason="this CPU's kernel does not take 4-bit weights by default")
def test_the_engine_on_4bit_weights_writes_what_it_writes_on_bf16_weights():
    """`--weights auto` on the GGUF preset: every decoder linear multiplies its 4-bit form; greedy DFlash equals plain
    decoding on them and plain decoding on the bf16 weights, token for token, alone and batched; `--weights bf16`
    keeps the bf16 path."""
    from trtllm_dflash.engine.runtime import DFlashEngine

    four = DFlashEngine.load("smollm2-135m", dtype="bf16", speculation="fixed", progress=lambda m: None)
    dense = DFlashEngine.load("smollm2-135m", dtype="bf16", weights="bf16", no_draft=True, progress=lambda m: None)
    assert four.target_weights == "4-bit" and four.target.four_bit == 30 * 4 and dense.target_weights == "bf16"
    plain = DFlashEngine(four.target, None, 1)
    wants = {}
    for text, chat in PROMPTS:
        ids = four.encode(text, chat)
        wants[text] = want = [t for step, _ in dense.stream(ids, max_new_tokens=MAX_NEW) for t in step]
        assert [t for step, _ in plain.stream(ids, max_new_tokens=MAX_NEW) for t in step] == want, text
        assert [t for step, _ in four.stream(ids, max_new_tokens=MAX_NEW) for t in step] == want, text
    scheduler = four.scheduler(len(PROMPTS), 512)
    results = {}

    def client(text, chat):
        steps = four.stream(four.encode(text, chat), max_new_tokens=MAX_NEW, scheduler=scheduler)
        results[text] = [t for step, _ in steps for t in step]

    threads = [threading.Thread(target=client, args=p) for p in PROMPTS]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        scheduler.stop()
    assert results == wants
