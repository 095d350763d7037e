"""The quantization formats `trtdflash convert` writes: one table, read by the converter, the CLI and the tests.

`quant_algo` is what ModelOpt 0.47.0's unified HF export writes into hf_quant_config.json
(modelopt/torch/export/quant_utils.py::process_layer_quant_config) and what TensorRT-LLM parses with
`QuantAlgo(...)` (tensorrt_llm/_torch/model_config.py::_build_modelopt_quant_config,
tensorrt_llm/quantization/mode.py::QuantAlgo).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantFormat:
    name: str  # CLI spelling
    modelopt_cfg: str  # attribute of modelopt.torch.quantization holding the preset config
    quant_algo: str  # hf_quant_config.json "quant_algo"
    group_size: int | None  # elements per weight scale (None: one per-tensor scale)
    weight_scale_bits: tuple[int, int] | None  # (exponent, mantissa) bits of the block scale; None for per-tensor FP8
    activation_scale: bool  # a static per-tensor `input_scale` is calibrated and written


FORMATS = {
    f.name: f
    for f in (
        QuantFormat("fp8", "FP8_DEFAULT_CFG", "FP8", None, None, True),
        QuantFormat("nvfp4", "NVFP4_DEFAULT_CFG", "NVFP4", 16, (4, 3), True),
        # ModelOpt writes lower-case "mxfp4" (no group_size): W4A4 with dynamic MXFP4 activations. TensorRT-LLM's
        # QuantAlgo has no such member (only W4A8_MXFP4_FP8 / W4A8_MXFP4_MXFP8 / W4A16_MXFP4), so a TensorRT-LLM
        # deployment of dense MXFP4 weights should use w4a8_mxfp4_fp8.
        QuantFormat("mxfp4", "MXFP4_DEFAULT_CFG", "mxfp4", 32, (8, 0), False),
        QuantFormat("w4a8_mxfp4_fp8", "W4A8_MXFP4_FP8_CFG", "W4A8_MXFP4_FP8", 32, (8, 0), True),
    )
}
KV_CACHE_FORMATS = {"none": None, "fp8": "FP8_KV_CFG"}  # name -> modelopt.torch.quantization preset
KV_CACHE_QUANT_ALGO = {"fp8": "FP8"}

# Tensor-name suffixes of the scales ModelOpt's export writes (always fp32 or FP8/E8M0 codes; never recast).
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
