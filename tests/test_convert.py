"""`trtdflash convert`: the written files decoded by an independent reader agree bit for bit with ModelOpt's own
dequantization, stay within each format's error bound, and carry the config keys TensorRT-LLM reads."""

import json
import shutil

import pytest
import torch
from conftest import make_random_draft
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trtllm_dflash.convert import ConvertOptions, convert_checkpoint
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.models.checkpoint import check_draft, read_draft_config
from trtllm_dflash.resolve import DRAFTS_DIR

DRAFT = DRAFTS_DIR / "smollm2-135m"
QUIET = lambda m: None  # noqa: E731

# ---------------------------------------------------------------------------------------------------------------
# Independent decoder: written from the format definitions (OCP MX spec for E2M1/E8M0; NVFP4 = E2M1 codes, E4M3
# scale per 16, fp32 global scale), not from the conversion code or ModelOpt. fp32 products in the order the format
# defines them: NVFP4 block scale = weight_scale * weight_scale_2, then times the E2M1 value.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> codes [..., n]: element 2j in the low nibble, 2j+1 in the high one."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    codes = e2m1_codes(packed).long()
    sign = torch.where(codes & 8 != 0, -1.0, 1.0)
    return sign * E2M1[codes & 7]


def decode_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.float32) * scale.to(torch.float32)


def decode_nvfp4(weight, scale, scale_2) -> torch.Tensor:
    vals = e2m1_values(weight)
    out, n = vals.shape
    block = scale.to(torch.float32) * scale_2.to(torch.float32)  # [out, n/16]
    return (vals.view(out, n // 16, 16) * block[..., None]).view(out, n)


def decode_mxfp4(weight, scale) -> torch.Tensor:
    vals = e2m1_values(weight)
    out, n = vals.shape
    exponent = scale.to(torch.int32) - 127
    block = torch.ldexp(torch.ones(exponent.shape), exponent)  # E8M0: 2^(s - 127), exact
    return (vals.view(out, n // 32, 32) * block[..., None]).view(out, n)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical fp32, zeros compared without their sign: E2M1 code 0b1000 is -0 in the OCP spec (our decoder),
    ModelOpt's table maps it to +0 (qtensor/nvfp4_tensor.py e2m1_values); every other bit must match."""
    return torch.equal((a + 0.0).view(torch.int32), (b + 0.0).view(torch.int32))


def block_scale(decoded_scale: torch.Tensor, group: int) -> torch.Tensor:
    return decoded_scale.repeat_interleave(group, dim=-1)


# ModelOpt's own dequantization of the same written tensors (modelopt 0.47.0 qtensor/*.py)
def modelopt_dequant(kind: str, t: dict) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, NVFP4QTensor

    w = t["weight"]
    if kind == "fp8":
        return FP8QTensor(w.shape, torch.float32, w).dequantize(torch.float32, scale=t["weight_scale"])
    shape = (w.shape[0], w.shape[1] * 2)
    if kind == "nvfp4":
        return NVFP4QTensor(shape, torch.float32, w).dequantize(
            torch.float32, scale=t["weight_scale"], double_scale=t["weight_scale_2"], block_sizes={-1: 16}
        )
    return MXFP4QTensor(shape, torch.float32, w).dequantize(
        torch.float32, scale=t["weight_scale"], block_sizes={-1: 32}
    )


def decode(kind: str, t: dict) -> torch.Tensor:
    if kind == "fp8":
        return decode_fp8(t["weight"], t["weight_scale"])
    if kind == "nvfp4":
        return decode_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
    return decode_mxfp4(t["weight"], t["weight_scale"])


def error_bound(kind: str, t: dict, source: torch.Tensor) -> torch.Tensor:
    """Largest allowed |source - decoded| per element.

    FP8 E4M3 (3 mantissa bits, round to nearest): 2^-4 relative in the normal range, half the smallest subnormal
    step (2^-10 * scale) below it. NVFP4 / MXFP4: E2M1's widest gap is 4 -> 6, so rounding moves a value by at
    most 1 block scale S, and a value past 6·S saturates to 6·S: bound max(S, |x| - 6·S). With a normal E4M3 block
    scale |x| <= 6·S·(1 + 2^-4), so the bound is S; a subnormal block scale (coarse, clamped at 2^-9) can round
    down far enough for saturation to dominate. MXFP4's power-of-two scale >= amax/6 never saturates.
    """
    if kind == "fp8":
        return source.abs() * 2.0**-4 + t["weight_scale"].float() * 2.0**-10
    if kind == "nvfp4":
        scale = block_scale(t["weight_scale"].float() * t["weight_scale_2"].float(), 16)
        return torch.maximum(scale, source.abs() - 6 * scale)
    exponent = t["weight_scale"].to(torch.int32) - 127
    return block_scale(torch.ldexp(torch.ones(exponent.shape), exponent), 32)


def layer_tensors(files, prefix: str) -> dict:
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                if k.startswith(prefix + "."):
                    out[k[len(prefix) + 1 :]] = st.get_tensor(k)
    return out


def assert_bit_exact_and_bounded(kind: str, t: dict, source: torch.Tensor | None) -> None:
    ours, theirs = decode(kind, t), modelopt_dequant(kind, t)
    assert ours.shape == theirs.shape
    assert same_bits(ours, theirs.float()), "decoders disagree bit for bit"
    if source is not None:
        err = (source.float() - ours).abs()
        assert (err <= error_bound(kind, t, source.float()) * (1 + 1e-6) + 1e-30).all(), f"{kind} error {err.max()}"


# ---------------------------------------------------------------------------------------------------------------
# Real conversions (module-scoped: each runs once)
WEIGHT_KIND = {"fp8": "fp8", "nvfp4": "nvfp4", "mxfp4": "mxfp4", "w4a8_mxfp4_fp8": "mxfp4"}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.fixture(scope="module")
def converted(quantized):
    """{name: output dir}: the SmolLM2 target in FP8 with an FP8 KV cache and in NVFP4, each whole and offloaded
    (layer by layer), the packaged draft in each FP4 format."""
    return {
        **{
            f"target-{q}{tag}": quantized(q, kv_cache_quant=kv, offload=offload)
            for q, kv in (("fp8", "fp8"), ("nvfp4", "none"))
            for tag, offload in (("", False), ("-offload", True))
        },
        **{f"draft-{q}": quantized(q, role="draft") for q in ("nvfp4", "mxfp4", "w4a8_mxfp4_fp8")},
    }


def test_target_fp8_decodes_bit_exact_and_within_bound(converted, target_dir):
    out = converted["target-fp8"]
    src = load_file(target_dir / "model.safetensors")
    files = sorted(out.glob("*.safetensors"))
    for layer in (0, 15, 29):
        for lin in LINEARS:
            prefix = f"model.layers.{layer}.{lin}"
            t = layer_tensors(files, prefix)
            assert (
                t["weight"].dtype == torch.float8_e4m3fn
                and t["weight_scale"].shape == ()
                and t["input_scale"].shape == ()
            )
            assert_bit_exact_and_bounded("fp8", t, src[f"{prefix}.weight"])
    kv = layer_tensors(files, "model.layers.3.self_attn")
    assert kv["k_proj.k_scale"].dtype == torch.float32 and kv["v_proj.v_scale"].shape == ()
    assert kv["k_proj.k_scale"] > 0 and kv["v_proj.v_scale"] > 0


@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4", "w4a8_mxfp4_fp8"])
def test_draft_fp4_decodes_bit_exact_and_within_bound(converted, quant):
    out = converted[f"draft-{quant}"]
    kind = WEIGHT_KIND[quant]
    src = load_file(DRAFT / "model.safetensors")
    group = 16 if kind == "nvfp4" else 32
    for layer in range(3):
        for lin in LINEARS:
            prefix = f"layers.{layer}.{lin}"
            t = layer_tensors([out / "model.safetensors"], prefix)
            w = src[f"{prefix}.weight"]
            assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (w.shape[0], w.shape[1] // 2)
            assert t["weight_scale"].dtype == (torch.float8_e4m3fn if kind == "nvfp4" else torch.uint8)
            assert t["weight_scale"].shape == (w.shape[0], w.shape[1] // group)
            assert ("input_scale" in t) == (quant != "mxfp4")
            assert_bit_exact_and_bounded(kind, t, w)


def test_draft_keeps_zlab_layout_and_loads(converted):
    for quant in ("nvfp4", "mxfp4", "w4a8_mxfp4_fp8"):
        out = converted[f"draft-{quant}"]
        with safe_open(out / "model.safetensors", framework="pt") as st:
            names = set(st.keys())
            assert st.get_tensor("fc.weight").dtype == torch.bfloat16  # high precision, in the draft's own dtype
            assert st.get_tensor("norm.weight").dtype == torch.bfloat16
        assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in names)
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.mlp.down_proj.weight"} <= names
        raw = json.loads((out / "config.json").read_text())
        assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["target_layer_ids"] == [1, 14, 27]
        assert read_draft_config(out).num_hidden_layers == 3
        check_draft(out)


# Values TensorRT-LLM's QuantAlgo accepts (tensorrt_llm/quantization/mode.py) and the keys
# tensorrt_llm/quantization/modelopt_config.py::_read_legacy reads; "mxfp4" is ModelOpt's own lower-case name.
EXPECTED = {
    "target-fp8": {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["lm_head", "model.embed_tokens"],
    },
    "draft-nvfp4": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["fc"]},
    "draft-mxfp4": {"quant_algo": "mxfp4", "kv_cache_quant_algo": None, "exclude_modules": ["fc"]},
    "draft-w4a8_mxfp4_fp8": {
        "quant_algo": "W4A8_MXFP4_FP8",
        "kv_cache_quant_algo": None,
        "group_size": 32,
        "exclude_modules": ["fc"],
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quant_config_has_what_tensorrt_llm_reads(converted, name):
    out = converted[name]
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["producer"] == {"name": "modelopt", "version": "0.47.0"}
    assert hf["quantization"] == EXPECTED[name]
    inline = json.loads((out / "config.json").read_text())["quantization_config"]
    assert inline["quant_method"] == "modelopt" and inline["quant_algo"] == EXPECTED[name]["quant_algo"]
    assert sorted(inline["ignore"]) == sorted(EXPECTED[name]["exclude_modules"])
    card = json.loads((out / "quantization.json").read_text())
    assert card["modelopt_version"] == "0.47.0" and card["calibration"]["samples"] == 2 and card["peak_rss_mb"] > 0
    assert 0 < card["calibration"]["top1_agreement_fake_quant"] <= 1


def test_target_output_is_loadable_hf_folder(converted, target_dir):
    out = converted["target-fp8"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (target_dir / name).read_bytes()
    with safe_open(out / "model.safetensors", framework="pt") as st:
        assert st.get_tensor("model.norm.weight").dtype == torch.float32  # the source dtype
        assert st.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def checkpoint_tensors(out) -> dict:
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    return tensors


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_offloaded_target_writes_the_same_checkpoint(converted, quant):
    """Layer by layer (disk offload, ModelOpt's layerwise max calibration and streaming export) writes the whole
    path's tensors bit for bit: each layer's max calibration sees the same full-precision inputs, computed by the
    same fp32 ops on the same batches, and max is order-independent. Only the file header differs: ModelOpt's
    streaming writer leaves out save_pretrained's {"format": "pt"} metadata (and shards above 512 MB)."""
    whole, offloaded = converted[f"target-{quant}"], converted[f"target-{quant}-offload"]
    a, b = checkpoint_tensors(whole), checkpoint_tensors(offloaded)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        assert (t.dtype, t.shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(t.reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name
    for f in ("hf_quant_config.json", "config.json"):
        assert json.loads((whole / f).read_text()) == json.loads((offloaded / f).read_text())
    cards = [json.loads((d / "quantization.json").read_text()) for d in (whole, offloaded)]
    assert [c["offload"] for c in cards] == [False, True]
    assert cards[0]["calibration"] == cards[1]["calibration"]
    assert not list(offloaded.parent.glob(".*offload*"))


# ---------------------------------------------------------------------------------------------------------------
# Crafted tensors: ModelOpt quantizes them, we write them with safetensors, both decoders read the file back.
def write_and_read(tmp_path, tensors: dict) -> dict:
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "t.safetensors")
    return load_file(tmp_path / "t.safetensors")


def crafted_cases():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(8, 64, generator=g)
    tiny_block = normal.clone()
    tiny_block[:, :32] *= 1e-5  # blocks whose E4M3 scale is subnormal (amax_b / (6 * scale_2) < 2^-6)
    at_max = torch.tensor([[6.0, -6.0, 4.0, 0.5] * 16] * 4)  # exactly the E2M1 grid: decoded without error
    return {
        "zeros": torch.zeros(4, 64),
        "normal": normal,
        "subnormal_scales": tiny_block,
        "at_max": at_max,
        "tiny": torch.full((2, 64), 1e-30),
    }


@pytest.mark.parametrize("case", sorted(crafted_cases()))
@pytest.mark.parametrize("kind", ["fp8", "nvfp4", "mxfp4"])
def test_crafted_tensors_bit_exact(tmp_path, kind, case):
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, NVFP4QTensor

    x = crafted_cases()[case]
    if case == "zeros" and kind != "mxfp4":
        pytest.skip(
            "ModelOpt's per-tensor scale of an all-zero weight is 0 (0/0 on quantize); such weights need excluding"
        )
    if kind == "fp8":
        q, s = FP8QTensor.quantize(x)
        t = write_and_read(tmp_path, {"weight": q._quantized_data, "weight_scale": s.float()})
    elif kind == "nvfp4":
        q, s, s2 = NVFP4QTensor.quantize(x, 16)
        t = write_and_read(tmp_path, {"weight": q._quantized_data, "weight_scale": s, "weight_scale_2": s2.float()})
        if case == "subnormal_scales":  # some block scales are E4M3 subnormals and their blocks saturate
            scale = block_scale(t["weight_scale"].float() * t["weight_scale_2"], 16)
            assert (t["weight_scale"].float() < 2.0**-6).any() and ((x - decode(kind, t)).abs() > scale).any()
    else:
        q, s = MXFP4QTensor.quantize(x, 32)
        t = write_and_read(tmp_path, {"weight": q._quantized_data, "weight_scale": s.view(x.shape[0], -1)})
    assert_bit_exact_and_bounded(kind, t, x)
    if case == "at_max" and kind != "fp8":
        assert torch.equal(decode(kind, t), x)


def test_nvfp4_values_beyond_block_maximum_clamp_to_six(tmp_path):
    """Block scales forced below amax/6: values past 6 x scale saturate to ±6 (E2M1 has no inf), both decoders agree."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    x = torch.linspace(-10, 10, 64).repeat(2, 1)
    s2 = torch.tensor(1.0)
    s = torch.full((2, 4), 1.0).to(torch.float8_e4m3fn)  # block max representable = 6 < 10
    q, s, s2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor=s, weights_scaling_factor_2=s2)
    t = write_and_read(tmp_path, {"weight": q._quantized_data, "weight_scale": s, "weight_scale_2": s2})
    ours = decode("nvfp4", t)
    assert same_bits(ours, modelopt_dequant("nvfp4", t))
    assert ours.abs().max() == 6 and torch.equal(ours[x.abs() >= 5], 6 * x[x.abs() >= 5].sign())


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one DFlashError sentence, nothing written
def assert_nothing_written(out):
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp*"))


def test_nan_in_source_is_refused(tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT, bad)
    state = load_file(bad / "model.safetensors")
    state["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, bad / "model.safetensors")
    out = tmp_path / "out"
    with pytest.raises(DFlashError, match=r"layers\.1\.mlp\.up_proj\.weight .*NaN/Inf"):
        convert_checkpoint(
            ConvertOptions(model=str(bad), quant="nvfp4", output=out, target="smollm2-135m"), progress=QUIET
        )
    assert_nothing_written(out)


def test_misshaped_tensor_is_refused(tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT, bad)
    state = load_file(bad / "model.safetensors")
    state["layers.0.self_attn.o_proj.weight"] = state["layers.0.self_attn.o_proj.weight"][:, :512].clone()
    save_file(state, bad / "model.safetensors")
    out = tmp_path / "out"
    with pytest.raises(DFlashError, match="o_proj.weight has shape"):
        convert_checkpoint(
            ConvertOptions(model=str(bad), quant="fp8", output=out, target="smollm2-135m"), progress=QUIET
        )
    assert_nothing_written(out)


def test_exclude_matching_nothing_is_refused(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(DFlashError, match="--exclude 'layers.9.*' matches no Linear"):
        convert_checkpoint(
            ConvertOptions(model=str(DRAFT), quant="fp8", exclude=("layers.9.*",), output=out), progress=QUIET
        )
    assert_nothing_written(out)


def test_format_the_architecture_cannot_take_is_refused(tmp_path, target):
    src = make_random_draft(target, tmp_path / "odd", num_layers=1, intermediate_size=1000)  # 1000 % 32 != 0
    out = tmp_path / "out"
    with pytest.raises(
        DFlashError, match=r"mxfp4 quantizes blocks of 32 input features, but layers\.0\.mlp\.down_proj has 1000"
    ):
        convert_checkpoint(
            ConvertOptions(model=str(src), quant="mxfp4", output=out, target="smollm2-135m"), progress=QUIET
        )
    assert_nothing_written(out)


def test_output_holding_another_model_is_refused(tmp_path, target_dir):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(target_dir / "config.json", out / "config.json")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(DFlashError, match="already holds other files"):
        convert_checkpoint(ConvertOptions(model=str(DRAFT), quant="fp8", output=out), progress=QUIET)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not list(tmp_path.glob(".out.tmp*"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quant": "int3"}, "Unknown --quant 'int3'"),
        ({"quant": "fp8", "role": "target"}, "is a DFlash draft, but --role is target"),
        ({"quant": "fp8", "kv_cache_quant": "fp8"}, "--kv-cache-quant is for targets"),
        ({"quant": "fp8", "calib_samples": 0}, "--calib-samples must be at least 1"),
        ({"quant": "fp8", "offload": True}, "--offload is for targets"),
        ({"quant": "fp8", "calib_data": "/nonexistent.jsonl"}, "neither gsm8k, code, chat nor an existing file"),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, message):
    with pytest.raises(DFlashError, match=message.replace("(", r"\(").replace("*", r"\*")):
        ConvertOptions(model=str(DRAFT), output=tmp_path / "out", **kwargs)


def test_a_second_conversion_into_the_same_output_is_refused_and_leftovers_are_cleared(tmp_path):
    from trtllm_dflash.atomic import locked

    out = tmp_path / "draft-fp8"
    opts = ConvertOptions(model=str(DRAFT), quant="fp8", calib_data="chat", calib_samples=1, output=out)
    with locked(out, "conversion"):  # another writer holds the output (its own open file: flock conflicts)
        with pytest.raises(DFlashError, match="Another conversion .* is writing"):
            convert_checkpoint(opts, progress=QUIET)
    assert not out.exists()
    killed = [tmp_path / ".draft-fp8.tmp999999", tmp_path / ".draft-fp8.offload999999"]  # what a SIGKILLed run leaves
    for d in killed:
        d.mkdir()
        (d / "part.safetensors").write_bytes(b"half")
    said = []
    convert_checkpoint(opts, progress=said.append)
    assert check_draft(out) is not None and not any(d.exists() for d in killed)
    assert any("Cleaned up after an interrupted conversion" in m for m in said)
