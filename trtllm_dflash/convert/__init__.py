"""`trtdflash convert`: FP8 / NVFP4 / MXFP4 checkpoints of a target or a DFlash draft with NVIDIA Model Optimizer.

On-disk format (ModelOpt 0.47.0 unified HF export, as TensorRT-LLM's PyTorch backend loads it). Every quantized
Linear `P` (out × in) is written as: FP8 — `P.weight` float8_e4m3fn [out, in], `P.weight_scale` fp32 [] (amax/448),
`P.input_scale` fp32 [] (activation amax/448); w = weight · weight_scale. NVFP4 — `P.weight` uint8 [out, in/2]
(two E2M1 codes per byte, element 2j in the LOW nibble, code = sign<<3 | idx into {0, .5, 1, 1.5, 2, 3, 4, 6}),
`P.weight_scale` float8_e4m3fn [out, in/16] (per 16 elements, unswizzled), `P.weight_scale_2` fp32 [] (amax/(6·448)),
`P.input_scale` fp32 []; w = e2m1 · weight_scale · weight_scale_2. MXFP4 / W4A8_MXFP4_FP8 — `P.weight` uint8
[out, in/2] (same packing), `P.weight_scale` uint8 [out, in/32] (E8M0: 2^(s−127)); w = e2m1 · 2^(s−127); W4A8 adds
`P.input_scale` fp32 [] (FP8 activations, amax/448), plain mxfp4 has none (dynamic MXFP4 activations).
q/k/v (and gate/up) share `input_scale` and `weight_scale_2`. An FP8 KV cache adds `*.self_attn.k_proj.k_scale`
and `*.self_attn.v_proj.v_scale` fp32 [] (amax/448). Everything else (norms, embeddings, LM head, MoE routers, the
draft's `fc`) keeps the source dtype. `hf_quant_config.json` = {"producer": {"name": "modelopt", "version"},
"quantization": {"quant_algo": "FP8"|"NVFP4"|"mxfp4"|"W4A8_MXFP4_FP8", "kv_cache_quant_algo": "FP8"|null,
"group_size": 16|32 (NVFP4 / W4A8 only), "exclude_modules": [...]}}; `config.json["quantization_config"]` mirrors it
(ModelOpt's flat form, `quant_method: "modelopt"`). A target keeps its HF names (`model.layers.N...`) plus its
tokenizer files and generation config; a draft keeps the z-lab layout (`fc`, `hidden_norm`, `layers.N.*`, `norm`, no
embedding or LM head) and its own config.json with `dflash_config`. `quantization.json` is our card (format,
calibration, excluded modules, ModelOpt version, time, peak RSS).
"""

from trtllm_dflash.convert.core import ConvertOptions, convert_checkpoint
from trtllm_dflash.convert.formats import FORMATS, KV_CACHE_FORMATS

__all__ = ["ConvertOptions", "convert_checkpoint", "FORMATS", "KV_CACHE_FORMATS"]
