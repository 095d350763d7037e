"""A CPU implementation of ModelOpt's dynamic block (NVFP4 / MXFP4) fake quantization.

ModelOpt 0.47.0 fake-quantizes dynamic blocks only on CUDA (modelopt/torch/quantization/tensor_quant.py
`_dynamic_block_quantize_impl` asserts `amax.is_cuda`; the MX path needs a CUDA extension). Its hook for another
implementation is `register_quant_backend` (modelopt/torch/quantization/nn/modules/tensor_quantizer.py: the
quantizer's `backend` field routes `_fake_quantize` to `entrypoint(inputs, quantizer)`). Ours rounds through
ModelOpt's own reference qtensors (qtensor/nvfp4_tensor.py, qtensor/mxfp4_tensor.py), i.e. the same arithmetic
its export writes, so a CPU forward of the quantized model sees exactly the exported weights.
"""

from __future__ import annotations

import torch

from trtllm_dflash.convert.formats import E2M1_MAX, FP8_E4M3_MAX

BACKEND = "trtdflash_cpu_block"


def _fake_quant(inputs: torch.Tensor, quantizer) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor

    block = quantizer.block_sizes.get(-1) or quantizer.block_sizes.get(inputs.dim() - 1)
    x = inputs.float()
    if tuple(quantizer.block_sizes.get("scale_bits")) == (4, 3):  # NVFP4: FP8 block scales under an fp32 global scale
        amax = quantizer.amax
        scale_2 = None if amax is None else amax.float() / (E2M1_MAX * FP8_E4M3_MAX)
        q, scale, scale_2 = NVFP4QTensor.quantize(x, block, weights_scaling_factor_2=scale_2)
        out = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: block})
    else:  # MXFP4: E8M0 block scales
        q, scale = MXFP4QTensor.quantize(x, block)
        out = q.dequantize(dtype=torch.float32, scale=scale, block_sizes={-1: block})
    return out.reshape(inputs.shape).to(inputs.dtype)


def register() -> str:
    """Register once per process; returns the backend name to put in a quantizer config."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )

    if not is_registered_quant_backend(BACKEND):
        register_quant_backend(BACKEND, _fake_quant)
    return BACKEND
