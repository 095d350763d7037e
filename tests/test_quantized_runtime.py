"""ModelOpt-quantized SmolLM2 checkpoints (written by `trtdflash convert`) on the embedded runtime: decoded and rounded
as the format means, greedy DFlash token-identical to greedy decoding of the same quantized target, served unchanged.

The checkpoints are conftest's `quantized` ones, which test_convert.py decodes bit by bit (the FP8 target with its
FP8 KV cache).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_quantized_runtime.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_dflash.clients.client import CompletionRequest, complete
from trtllm_dflash.config import SamplingParams
from trtllm_dflash.deploy import BuildOptions, run_build
from trtllm_dflash.engine.batch import speculative_stream
from trtllm_dflash.engine.request import GenerationStats
from trtllm_dflash.engine.runtime import DFlashEngine
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import load_draft
from trtllm_dflash.models.quantized import QuantLinear, read_quant_spec
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.resolve import resolve_draft
from trtllm_dflash.serving.serve import ServerConfig, TritonServer

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
MAX_NEW = 24
TRTDFLASH = str(Path(sys.executable).parent / "trtdflash")


@pytest.fixture(scope="module")
def packaged_draft():
    return resolve_draft(None, "smollm2-135m")


@pytest.fixture(scope="module", params=["fp8", "nvfp4", "mxfp4"])
def quantized_target(request, quantized, packaged_draft):
    tm = TargetModel.load(quantized(request.param, kv_cache_quant="fp8" if request.param == "fp8" else "none"))
    tm.set_taps(load_draft(packaged_draft).config.target_layer_ids)
    return request.param, tm


def _greedy(target, draft, ids, block):
    stats = GenerationStats()
    out = [
        t
        for s in speculative_stream(target, draft, ids, MAX_NEW, block, SamplingParams(), frozenset({2}), stats)
        for t in s
    ]
    return out, stats


def test_dflash_on_a_quantized_target_is_lossless(quantized_target, packaged_draft):
    """Greedy DFlash (block 16) == greedy block-1 decoding of the same quantized target, and the draft still helps."""
    fmt, tm = quantized_target
    draft = load_draft(packaged_draft)
    ids = DFlashEngine(tm, None, 1).encode(PROMPT)
    ref, ref_stats = _greedy(tm, None, ids, 1)
    out, stats = _greedy(tm, draft, ids, 16)
    assert out == ref, fmt
    assert ref_stats.acceptance_length == 1.0 and stats.acceptance_length > 1.2
    assert sum(isinstance(m, QuantLinear) for m in tm.model.modules()) == 7 * tm.num_layers


def test_a_layer_equals_dequantized_weight_times_fake_quantized_input(quantized_target):
    """Independent reference: ModelOpt's own qtensor decoding of the stored weight, and the activation rounding
    written out from the format's definition (not the module's helpers)."""
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

    fmt, tm = quantized_target
    layer = tm.model.model.layers[5].mlp.down_proj
    raw = load_file(tm.path / "model.safetensors")
    p = "model.layers.5.mlp.down_proj"
    if fmt == "fp8":
        w = raw[f"{p}.weight"].double() * raw[f"{p}.weight_scale"].double()
    elif fmt == "nvfp4":
        w = (
            NVFP4QTensor((layer.out_features, layer.in_features), torch.float32, raw[f"{p}.weight"])
            .dequantize(
                dtype=torch.float32,
                scale=raw[f"{p}.weight_scale"],
                double_scale=raw[f"{p}.weight_scale_2"],
                block_sizes={-1: 16},
            )
            .double()
        )
    else:
        w = (
            MXFP4QTensor((layer.out_features, layer.in_features), torch.float32, raw[f"{p}.weight"])
            .dequantize(dtype=torch.float32, scale=raw[f"{p}.weight_scale"], block_sizes={-1: 32})
            .double()
        )
    assert torch.allclose(layer.weight, w, rtol=1e-6, atol=0)  # ModelOpt decodes in fp32; ours is exact (float64)

    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    if fmt == "fp8":  # e4m3(x / s) · s, saturating
        s = float(raw[f"{p}.input_scale"])
        xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    elif fmt == "nvfp4":  # per 16: sf = e4m3(amax/(6·s)) · s, values on the E2M1 grid (nearest, ties to even)
        s = float(raw[f"{p}.input_scale"])
        xb = x.view(3, -1, 16)
        sf = (xb.abs().amax(-1, keepdim=True) / (6 * s)).to(torch.float8_e4m3fn).double() * s
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
        y = (xb / sf).abs().clamp(max=6)
        dist = (y[..., None] - grid).abs()
        best = dist.min(-1, keepdim=True).values
        idx = (
            torch.where(dist == best, torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]) * 10 + torch.arange(8), 99).min(-1).values
            % 10
        )
        xq = (torch.sign(xb) * grid[idx] * sf).view(3, -1)
    else:  # MXFP8 activations (Blackwell default): per 32 a power of two >= amax/448, e4m3 values
        xb = x.view(3, -1, 32)
        sf = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True) / 448)))
        xq = ((xb / sf).to(torch.float8_e4m3fn).double() * sf).view(3, -1)
    ref = xq @ w.T
    out = layer(x.float())
    assert torch.equal(layer.quantize_input(x), xq)
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
    logits, _ = tm.forward(torch.tensor([[1, 2, 3, 4]]), 0, tm.new_cache(), capture=False)
    assert torch.isfinite(logits).all()


def test_fp8_kv_cache_and_quantized_draft(quantized, packaged_draft):
    """An FP8 target with an FP8 KV cache and an NVFP4 draft (convert --role draft): loads, drafts, stays lossless."""
    tm = TargetModel.load(quantized("fp8", kv_cache_quant="fp8"))
    assert read_quant_spec(tm.path).kv_cache_quant_algo == "FP8" and tm.model.model.layers[0].self_attn.k_scale > 0
    draft = load_draft(quantized("nvfp4", role="draft"))
    assert sum(isinstance(m, QuantLinear) for m in draft.modules()) == 7 * draft.config.num_hidden_layers
    tm.set_taps(draft.config.target_layer_ids)
    ids = DFlashEngine(tm, None, 1).encode(PROMPT)
    ref, _ = _greedy(tm, None, ids, 1)
    out, stats = _greedy(tm, draft, ids, 16)
    assert out == ref and stats.accepted_tokens > 0


def test_bad_quantized_checkpoints_are_one_sentence(quantized, tmp_path):
    src = quantized("nvfp4")

    def broken(name, edit_config=None, edit_state=None):
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        if edit_config:
            cfg = json.loads((d / "hf_quant_config.json").read_text())
            edit_config(cfg["quantization"])
            (d / "hf_quant_config.json").write_text(json.dumps(cfg))
        state = load_file(src / "model.safetensors")
        if edit_state:
            edit_state(state)
        save_file(state, d / "model.safetensors")
        return d

    cases = {
        "algo": (lambda q: q.update(quant_algo="INT3"), None, "quant_algo 'INT3'"),
        "scale": (None, lambda s: s.pop("model.layers.2.self_attn.o_proj.weight_scale_2"), "missing the scale tensor"),
        "shape": (
            None,
            lambda s: s.update(
                {
                    "model.layers.2.mlp.up_proj.weight_scale": s["model.layers.2.mlp.up_proj.weight_scale"][
                        :, :-1
                    ].contiguous()
                }
            ),
            "implies",
        ),
        "kv": (lambda q: q.update(kv_cache_quant_algo="FP8"), None, "k_scale"),
    }
    for name, (cfg, state, words) in cases.items():
        with pytest.raises(DFlashError, match=words) as e:
            TargetModel.load(broken(name, cfg, state))
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_quantized_target_served_by_triton_equals_generate(quantized, packaged_draft, tmp_path):
    """build (torch backend) + the real tritonserver + one gRPC completion == `trtdflash generate` on the same NVFP4 target."""
    target = quantized("nvfp4")
    build = run_build(
        BuildOptions(
            output=tmp_path / "build",
            target=str(target),
            draft=str(packaged_draft),
            block_size=4,
            max_seq_len=256,
            max_batch_size=1,
            speculation="fixed",
            dtype="fp32",
        ),
        progress=lambda m: None,
    )
    ref = json.loads(
        subprocess.run(
            [
                TRTDFLASH,
                "generate",
                "--target",
                str(target),
                "--draft",
                str(packaged_draft),
                "--block-size",
                "4",
                "--speculation",
                "fixed",
                "--max-new-tokens",
                "24",
                "--dtype",
                "fp32",
                "--prompt",
                "Name three colors.",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
    )
    server = TritonServer(ServerConfig(build, grpc_port=0, http_port=0, metrics_port=0)).start()
    try:
        done = complete(server.grpc_url, CompletionRequest("Name three colors.", 24, True), timeout=120)
    finally:
        server.stop()
    assert done.text == ref["text"] and done.num_tokens == ref["num_tokens"]
    assert done.accepted_tokens == ref["accepted_tokens"]
