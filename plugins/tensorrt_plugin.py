"""TensorRT plugin `trtdflash::block_attention`: the drafter engine's attention, run by the same Triton kernel.

Importing this module registers the plugin with TensorRT's Python plugin API (`tensorrt.plugin`, TensorRT >= 10.6,
"quickly deployable plugins"). The ONNX drafter (trtllm_dflash/deploy/draft_engine.py) carries the attention as a
node with op_type `block_attention` and a string attribute `plugin_namespace="trtdflash"`; TensorRT's ONNX parser
imports any node it does not know through its plugin registry by (op_type, plugin_version, plugin_namespace)
(onnx/onnx-tensorrt `onnxOpImporters.cpp`, FallbackPluginImporter), and the node's int attributes `causal`
and `window` arrive as this plugin's attributes.

The implementation is JIT (`trtp.impl`): TensorRT calls back into Python at enqueue time, so building and running
the engine both need this module imported first (the plan records the plugin by name, not its code).

Written against NVIDIA/TensorRT `python/packaging/bindings_wheel/tensorrt/plugin/` (`_top_level.py` register/impl/
autotune, `_tensor.py` Tensor, `_autotune.py` AutoTuneCombination) and `samples/python/quickly_deployable_plugins/`
(TensorRT 10.6-11.4). TensorRT's libraries cannot be installed on CPU-only machines; CI registers this file through
the real `tensorrt.plugin` package of the `tensorrt-cu12-bindings` wheel, with its native module stood in for
(tests/kernels/test_tensorrt_plugin.py). The kernel itself runs in the GPU check (examples/gpu_kernel_check.py).
"""

# No `from __future__ import annotations`: tensorrt.plugin validates the decorated functions' annotations as live
# classes (issubclass, typing.get_origin), and string annotations fail there on every TensorRT from 10.6 to 11.4.
from typing import List, Tuple

import numpy as np
import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from .block_attention import block_attention_into

PLUGIN_ID = "trtdflash::block_attention"  # = the torch op's name (trtllm_dflash.kernels.attention.OP)
FLOATS = "FP32|FP16|BF16"

# TensorRT dtype -> (array-interface type string, torch dtype). bf16 has no __cuda_array_interface__ type string
# (trtp.Tensor refuses it), so it is exposed as int16 bits and reinterpreted.
_TORCH_VIEW = {
    trt.DataType.FLOAT: ("<f4", torch.float32),
    trt.DataType.HALF: ("<f2", torch.float16),
    trt.DataType.BF16: ("<i2", torch.bfloat16),
    trt.DataType.INT32: ("<i4", torch.int32),
    trt.DataType.INT64: ("<i8", torch.int64),
}


class _Buffer:
    """A TensorRT buffer described with __cuda_array_interface__ so torch can view it without a copy."""

    def __init__(self, t: trtp.Tensor):
        typestr, _ = _TORCH_VIEW[t.dtype]
        itemsize = np.dtype(typestr).itemsize
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": typestr,
            "data": (t.data_ptr, False),
            "strides": tuple(s * itemsize for s in t.strides),
            "version": 3,
            "stream": None,  # ordered by the stream below
        }


def _view(t: trtp.Tensor) -> torch.Tensor:
    return torch.as_tensor(_Buffer(t), device="cuda").view(_TORCH_VIEW[t.dtype][1])


@trtp.register(PLUGIN_ID)
def _shape(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    ctx_k: trtp.TensorDesc,
    ctx_v: trtp.TensorDesc,
    ctx_lens: trtp.TensorDesc,
    causal: int,
    window: int,
) -> trtp.TensorDesc:
    """Output [b, nh, Q, hd]: q's shape and dtype."""
    return q.like()


@trtp.autotune(PLUGIN_ID)
def _formats(
    q: trtp.TensorDesc,
    k: trtp.TensorDesc,
    v: trtp.TensorDesc,
    ctx_k: trtp.TensorDesc,
    ctx_v: trtp.TensorDesc,
    ctx_lens: trtp.TensorDesc,
    outputs: Tuple[trtp.TensorDesc],
) -> List[trtp.AutoTuneCombination]:
    """Five float inputs and the output share one float type; ctx_lens is int32 or int64 independently."""
    return [trtp.AutoTuneCombination(f"{FLOATS}, {FLOATS}, {FLOATS}, {FLOATS}, {FLOATS}, INT32*INT64, {FLOATS}")]


@trtp.impl(PLUGIN_ID)
def _enqueue(
    q: trtp.Tensor,
    k: trtp.Tensor,
    v: trtp.Tensor,
    ctx_k: trtp.Tensor,
    ctx_v: trtp.Tensor,
    ctx_lens: trtp.Tensor,
    causal: int,
    window: int,
    outputs: Tuple[trtp.Tensor],
    stream: int,
) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        block_attention_into(
            _view(outputs[0]), *(_view(t) for t in (q, k, v, ctx_k, ctx_v, ctx_lens)), bool(causal), int(window)
        )
