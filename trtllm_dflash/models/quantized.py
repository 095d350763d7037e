"""ModelOpt-quantized checkpoints (unified HF format: FP8 / NVFP4 / MXFP4) on the embedded PyTorch runtime.

The weights are decoded from their storage format once at load; at run time each quantized linear
rounds its input activation the way TensorRT-LLM's PyTorch backend does before its low-precision GEMM,
then multiplies in the compute dtype. fp32 compute with the quantization rounding emulated is therefore
numerically what the deployed format means (up to GEMM accumulation order). Sources: TensorRT-LLM main
(`tensorrt_llm/_torch/modules/linear.py` at commit 00bbf71e, `cpp/tensorrt_llm/kernels/quantization.cuh`,
`tensorrt_llm/_torch/model_config.py`) and ModelOpt 0.47.0 (`modelopt/torch/quantization/qtensor/`):

* FP8 (`FP8QDQLinearMethod.apply`): activation quantized per tensor with the checkpoint's static
  `input_scale` (`static_quantize_e4m3_per_tensor`: e4m3(clamp(x / s, ±448))), FP8×FP8 GEMM, output ×
  weight_scale × input_scale. TensorRT-LLM also fuses q/k/v and gate/up and re-rounds their FP8 weights to
  the largest weight_scale (`rescale_fused_weights`); that second rounding is not emulated.
* NVFP4 (`NVFP4LinearMethod._input_prepare`, `fp4_quantize` → `cvt_warp_fp16_to_fp4`): per 16-element
  block along K, block scale sf = e4m3(amax_b / (6 · input_scale)) (RN, saturating), values
  e2m1(x / (sf · input_scale)) (RN-even, saturating at 6); GEMM alpha = input_scale · weight_scale_2.
* MXFP4 (`ModelConfig.get_mxfp4_quant_algo`): Blackwell runs W4A8_MXFP4_MXFP8 (activation MXFP8:
  per 32-block scale 2^ceil(log2(amax_b / 448)) as E8M0, values e4m3 — `mxfp8_quantize`,
  `cvt_warp_fp16_to_mxfp8`), Hopper W4A16_MXFP4 (weight-only). Chosen like TensorRT-LLM with the
  environment variable OVERRIDE_QUANT_ALGO; default W4A8_MXFP4_MXFP8 (Blackwell, non-Triton MoE backend).
  A W4A8_MXFP4_FP8 checkpoint's activations use its static input_scale (TensorRT-LLM's dense
  `W4A8MXFP4FP8LinearMethod.apply` ignores it and scales per call, which makes results depend on which
  tokens share a GEMM, so speculative decoding would no longer reproduce autoregressive output).
* FP8 KV cache (`kv_cache_quant_algo: FP8`, `k_proj.k_scale` / `v_proj.v_scale`): the attention reads
  K and V as e4m3(k / k_scale) · k_scale, which is what the cache stores; Q and softmax stay in compute precision.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.convert.formats import E2M1_MAX, FORMATS, FP8_E4M3_MAX, KV_CACHE_QUANT_ALGO
from trtllm_dflash.errors import DFlashError
from trtllm_dflash.kernels.packed import pack_linears
from trtllm_dflash.models.draft import DFlashDraftModel, apply_rope, rms_norm

HF_QUANT_CONFIG = "hf_quant_config.json"
QUANT_ALGOS = {f.quant_algo: f for f in FORMATS.values()}
KV_ALGOS = set(KV_CACHE_QUANT_ALGO.values())
MXFP4_ACTIVATIONS = ("W4A8_MXFP4_MXFP8", "W4A16_MXFP4")  # TensorRT-LLM on Blackwell / on Hopper
QUANTIZED_ATTENTION = "quantized_sdpa"  # no "flash" in the name: transformers routes those to hub kernels
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_TIES_UP = torch.tensor([0.75, 1.75, 3.5])  # round-half-even: these midpoints go to the even (larger) code


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's quantization config says, normalised as TensorRT-LLM's `read_modelopt_quant_config` does."""

    quant_algo: str
    kv_cache_quant_algo: str | None
    activations: str  # how linear inputs are rounded: FP8 | NVFP4 | MXFP8 | none

    @property
    def fmt(self):
        return QUANT_ALGOS[self.quant_algo]


def read_quant_spec(path: str | Path) -> QuantSpec | None:
    """hf_quant_config.json, else config.json's inline `quantization_config` (quant_method modelopt); None if unquantized."""
    path = Path(path)
    try:
        if (path / HF_QUANT_CONFIG).is_file():
            raw = json.loads((path / HF_QUANT_CONFIG).read_text()).get("quantization")
        else:
            raw = (
                json.loads((path / "config.json").read_text()).get("quantization_config")
                if (path / "config.json").is_file()
                else None
            )
            if not (isinstance(raw, dict) and str(raw.get("quant_method", "")).lower().startswith("modelopt")):
                return None
            if raw.get("kv_cache_scheme") is not None:  # ModelOpt's flat form writes the KV cache as a scheme
                scheme = raw["kv_cache_scheme"]
                raw = {
                    **raw,
                    "kv_cache_quant_algo": "FP8"
                    if (scheme.get("type"), scheme.get("num_bits")) == ("float", 8)
                    else str(scheme),
                }
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise DFlashError(
            f"The quantization config of {path} is not readable JSON ({e}); re-export the checkpoint."
        ) from None
    if not isinstance(raw, dict):
        raise DFlashError(
            f"{path / HF_QUANT_CONFIG} has no 'quantization' object; re-export the checkpoint with ModelOpt."
        )
    algo, kv = raw.get("quant_algo"), raw.get("kv_cache_quant_algo")
    if algo not in QUANT_ALGOS:
        raise DFlashError(
            f"Checkpoint {path} uses quant_algo {algo!r}; the embedded runtime runs {', '.join(QUANT_ALGOS)}."
        )
    if kv not in (None, *KV_ALGOS):
        raise DFlashError(
            f"Checkpoint {path} uses kv_cache_quant_algo {kv!r}; the embedded runtime runs {', '.join(sorted(KV_ALGOS))} or none."
        )
    fmt = QUANT_ALGOS[algo]
    if raw.get("group_size") not in (None, fmt.group_size):
        raise DFlashError(
            f"Checkpoint {path} says {algo} with group_size {raw['group_size']}; {algo} uses {fmt.group_size}."
        )
    if fmt.activation_scale:
        activations = "NVFP4" if fmt.weight_scale_bits == (4, 3) else "FP8"  # W4A8_MXFP4_FP8: FP8 activations
    else:
        mode = os.environ.get("OVERRIDE_QUANT_ALGO", MXFP4_ACTIVATIONS[0])
        if mode not in MXFP4_ACTIVATIONS:
            raise DFlashError(
                f"OVERRIDE_QUANT_ALGO={mode} is not runnable for {algo} weights without an activation scale; use one of {', '.join(MXFP4_ACTIVATIONS)}."
            )
        activations = "MXFP8" if mode == "W4A8_MXFP4_MXFP8" else "none"
    return QuantSpec(algo, kv, activations)


# --- element formats ------------------------------------------------------------------------------------


def round_fp8(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value (RN-even, saturating like CUDA's satfinite conversion), in x's dtype."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (RN-even, saturating at ±6, as `cvt.rn.satfinite.e2m1x2.f32`), in x's dtype."""
    a = x.abs()
    idx = torch.bucketize(a, _E2M1_MIDPOINTS.to(a.dtype)) + torch.isin(a, _E2M1_TIES_UP.to(a.dtype))
    return torch.copysign(E2M1_VALUES.to(x.dtype)[idx.clamp(max=7)], x)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] (element 2j in the low nibble) -> fp32 [..., n]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    return torch.where(codes >= 8, -E2M1_VALUES[codes & 7], E2M1_VALUES[codes & 7])


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    if (e == 255).any():
        raise DFlashError("An MXFP4 block scale is 0xFF (NaN in E8M0); re-export the checkpoint.")
    return torch.exp2(e.double() - 127)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] % size:
        raise DFlashError(f"A quantized linear's input width {x.shape[-1]} is not a multiple of its block size {size}.")
    return x.unflatten(-1, (-1, size))


# --- activation rounding (dtype in = dtype out) ---------------------------------------------------------


def qdq_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Static per-tensor FP8: e4m3(x / s) · s."""
    return round_fp8(x / scale) * scale


def qdq_nvfp4(x: torch.Tensor, input_scale: float, block: int = 16) -> torch.Tensor:
    """Dynamic per-block NVFP4 under the static global scale (TensorRT-LLM `fp4_quantize`)."""
    xb = _blocks(x, block)
    sf = round_fp8(xb.abs().amax(-1, keepdim=True) / (E2M1_MAX * input_scale)) * input_scale
    q = torch.where(sf > 0, round_e2m1(xb / torch.where(sf > 0, sf, 1.0)), 0.0)
    return (q * sf).flatten(-2)


def qdq_mxfp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Dynamic MXFP8: per block a power-of-two scale rounded up from amax/448 (E8M0), e4m3 values (`mxfp8_quantize`)."""
    xb = _blocks(x, block)
    mant, exp = torch.frexp(xb.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX)  # amax/448 = mant · 2^exp, mant in [0.5, 1)
    sf = torch.exp2((exp - (mant == 0.5).int()).clamp(-127, 127).to(x.dtype))  # smallest 2^k >= amax/448
    q = torch.where(mant > 0, round_fp8(xb / sf), 0.0)
    return (q * sf).flatten(-2)


# --- the linear -------------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A quantized nn.Linear: weight decoded once, input rounded per call; `weight` is the decoded matrix.

    Rounding is discontinuous: a GEMM that differs in the last fp32 bit between a 1-token and a 16-token
    forward would flip roundings downstream and make speculative output differ from autoregressive output.
    So the GEMM runs in float64 (the decoded weight is exact there) and is rounded back to the compute
    dtype, which makes its result independent of how many tokens share the forward.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activations: str, input_scale: float | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activations, self.input_scale = activations, input_scale

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as the low-precision GEMM sees it (float64)."""
        x = x.double()
        if self.activations == "FP8":
            return qdq_fp8(x, self.input_scale)
        if self.activations == "NVFP4":
            return qdq_nvfp4(x, self.input_scale)
        if self.activations == "MXFP8":
            return qdq_mxfp8(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={self.activations}"


def _scalar(state: dict, key: str) -> float:
    t = state.pop(key, None)
    if t is None:
        raise DFlashError(f"Quantized checkpoint is missing the scale tensor {key}; re-export it.")
    if t.numel() != 1 or not t.is_floating_point():
        raise DFlashError(
            f"Scale tensor {key} must be one float, got {t.dtype} {tuple(t.shape)}; re-export the checkpoint."
        )
    return float(t.float().reshape(()))


def _expect(state: dict, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = state.pop(key, None)
    if t is None:
        raise DFlashError(f"Quantized checkpoint is missing {key}; re-export it.")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise DFlashError(
            f"{key} is {t.dtype} {tuple(t.shape)}, but the quantization config implies {dtype} {shape}; re-export the checkpoint."
        )
    return t


def decode_weight(state: dict, prefix: str, spec: QuantSpec, out_features: int, in_features: int) -> torch.Tensor:
    """Pop `prefix.weight` and its scales from `state`; return the float64 weight [out, in] they encode (exactly)."""
    fmt, w = spec.fmt, f"{prefix}.weight"
    if fmt.group_size is None:  # FP8 per tensor
        q = _expect(state, w, torch.float8_e4m3fn, (out_features, in_features))
        return q.double() * _scalar(state, f"{prefix}.weight_scale")
    g = fmt.group_size
    if in_features % g:
        raise DFlashError(
            f"{w} has {in_features} input features, not a multiple of the {spec.quant_algo} block size {g}."
        )
    values = unpack_e2m1(_expect(state, w, torch.uint8, (out_features, in_features // 2))).double()
    if fmt.weight_scale_bits == (4, 3):  # NVFP4: e4m3 block scales under an fp32 global scale
        scale = _expect(state, f"{prefix}.weight_scale", torch.float8_e4m3fn, (out_features, in_features // g)).double()
        scale = scale * _scalar(state, f"{prefix}.weight_scale_2")
    else:  # MXFP4: E8M0 block scales
        scale = e8m0_to_float(_expect(state, f"{prefix}.weight_scale", torch.uint8, (out_features, in_features // g)))
    return (values.unflatten(-1, (-1, g)) * scale[..., None]).flatten(-2)


def replace_quantized_linears(model: nn.Module, state: dict, spec: QuantSpec, dtype: torch.dtype) -> int:
    """Swap every nn.Linear whose checkpoint entry carries a `weight_scale` for a QuantLinear; consumes its tensors."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.weight_scale" not in state:
            continue
        weight = decode_weight(state, name, spec, module.out_features, module.in_features)
        bias = state.pop(f"{name}.bias").double() if module.bias is not None and f"{name}.bias" in state else None
        if module.bias is not None and bias is None:
            raise DFlashError(f"Quantized checkpoint is missing {name}.bias; re-export it.")
        input_scale = _scalar(state, f"{name}.input_scale") if spec.activations in ("FP8", "NVFP4") else None
        state.pop(f"{name}.input_scale", None)  # MXFP4 weight-only / MXFP8 activations are scaled per block at run time
        parent, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model,
            child,
            QuantLinear(weight, bias, spec.activations, input_scale),
        )
        count += 1
    if not count:
        raise DFlashError(f"The checkpoint says {spec.quant_algo} but holds no quantized linear weights; re-export it.")
    return count


def _quantized_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA in float64, rounded back (batch-invariant, see QuantLinear), over K/V as an FP8 cache stores them
    when the checkpoint has one (k_scale / v_scale set on the attention module at load)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k, v = key.double(), value.double()
    if getattr(module, "k_scale", None) is not None:
        k, v = qdq_fp8(k, module.k_scale), qdq_fp8(v, module.v_scale)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.double()  # torch 2.13 SDPA misreads a float32 mask beside float64 queries
    out, weights = sdpa_attention_forward(module, query.double(), k, v, attention_mask, **kwargs)
    return out.to(query.dtype), weights


def _attach_kv_scales(model: nn.Module, state: dict) -> None:
    attns = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "k_proj", None), nn.Module)]
    if not attns:
        raise DFlashError(
            "The checkpoint asks for an FP8 KV cache, but the model has no k_proj/v_proj attention to apply it to."
        )
    for name, m in attns:
        m.k_scale = _scalar(state, f"{name}.k_proj.k_scale")
        m.v_scale = _scalar(state, f"{name}.v_proj.v_scale")


def _read_state(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / n for n in json.loads(index.read_text())["weight_map"].values()})
        if index.is_file()
        else sorted(path.glob("*.safetensors"))
    )
    if not files:
        raise DFlashError(f"Quantized checkpoint {path} has no *.safetensors weights (pickles are never loaded).")
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise DFlashError(f"{f} is not a readable safetensors file ({e}); re-export the checkpoint.") from None
    return state


def _load_rest(model: nn.Module, state: dict, dtype: torch.dtype, path: Path, allowed_missing: set[str]) -> None:
    """Load the unquantized tensors (they keep their meaning, cast to the compute dtype); strict about names."""
    decoded = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    expected = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in decoded}
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - allowed_missing)
    if unexpected or missing:
        raise DFlashError(
            f"Quantized checkpoint {path} does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}."
        )
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise DFlashError(
                f"{k} in {path} has shape {tuple(t.shape)}, but the config implies {tuple(expected[k].shape)}."
            )
    model.load_state_dict({k: t.to(dtype) for k, t in state.items()}, strict=False, assign=True)


def load_quantized_lm(path: str | Path, config, spec: QuantSpec, dtype: torch.dtype) -> nn.Module:
    """An HF causal LM skeleton (no random init) with the checkpoint's quantized linears swapped in."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    path = Path(path)
    state = _read_state(path)
    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    AttentionInterface.register(QUANTIZED_ATTENTION, _quantized_attention)
    AttentionMaskInterface.register(QUANTIZED_ATTENTION, sdpa_mask)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=QUANTIZED_ATTENTION)
    replace_quantized_linears(model, state, spec, dtype)
    if spec.kv_cache_quant_algo is not None:
        _attach_kv_scales(model, state)
    tied = {"lm_head.weight"} if getattr(config.get_text_config(), "tie_word_embeddings", False) else set()
    _load_rest(model, state, dtype, path, tied)  # ModelOpt drops a tied lm_head from the export
    model.tie_weights()
    return model.eval().requires_grad_(False)


def quantized_shapes(shapes: dict[str, tuple[int, ...]], spec: QuantSpec) -> dict[str, tuple[int, ...]]:
    """Header shapes -> the logical nn.Linear shapes (FP4 weights unpacked, scale tensors dropped), for name/shape checks."""
    scales = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
    out = {}
    for k, s in shapes.items():
        if k.rsplit(".", 1)[-1] in scales:
            continue
        packed = spec.fmt.group_size is not None and k.endswith(".weight") and f"{k}_scale" in shapes and len(s) == 2
        out[k] = (s[0], s[1] * 2) if packed else s
    return out


def load_quantized_draft(config, state: dict, spec: QuantSpec, dtype: torch.dtype, path: Path):
    """A quantized DFlash draft: fc, attention and MLP linears run like the target's; no FP8 KV cache (refused)."""
    if spec.kv_cache_quant_algo is not None:
        raise DFlashError(
            f"Draft {path} asks for a {spec.kv_cache_quant_algo} KV cache; quantize the draft's weights only (no --kv-cache)."
        )
    model = QuantizedDFlashDraft(config)
    replace_quantized_linears(model, state, spec, dtype)
    _load_rest(model, state, dtype, path, set())
    return model.eval().requires_grad_(False)


class QuantizedDFlashDraft(DFlashDraftModel):
    """Context K/V through each layer's own quantized k/v projection, as TensorRT-LLM runs them (each with its
    own input scale), instead of the unquantized draft's one stacked GEMM over all layers."""

    def pack(self) -> None:
        """Quantized linears keep their own forward (nothing fused); plain ones, such as `fc`, are prepacked."""
        pack_linears(self)
        self.packed = True

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        b, t, _ = ctx.shape
        attns = [layer.self_attn for layer in self.layers]
        kv = torch.cat([proj(ctx) for a in attns for proj in (a.k_proj, a.v_proj)], dim=-1)
        kv = kv.view(b, t, c.num_hidden_layers, 2, c.num_key_value_heads, c.head_dim).permute(2, 3, 0, 4, 1, 5)
        k = rms_norm(kv[:, 0], torch.stack([a.k_norm.weight for a in attns])[:, None, None, None, :], c.rms_norm_eps)
        cos, sin = self.rotary_emb(positions, ctx.dtype)
        return apply_rope(k, cos, sin), kv[:, 1]
