// The Python module of our CPU kernels, for every variant (bf16_gemm.py: VARIANTS). A file of its own so that torch's
// pybind11 headers, most of a build's time, compile on one core while the kernels compile on the other.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute calls release the GIL: in a server, the request threads build and send their responses on the other
  // core while the engine thread's forward runs, instead of waiting for each kernel call to return.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("pack", &bf16_blocks::pack, "W [N, K] -> [N/32, K/2, 32, 2]");
  m.def("linear", &linear, nogil, "x [..., K] with packed W -> [..., N]");
  m.def("linear_q4", &linear_q4, nogil, "x [..., K] with W as 4-bit records [N/32, K/32, 640] -> [..., N] (q4_blocks.h)");
#ifdef TRTDFLASH_INT8
  m.def("linear_int8", &linear_int8, nogil, "x [..., K] with int8 W packed by pack_int8 and its scales [N] -> [..., N]");
#endif
  m.def("attend", &slot_attention::attend, nogil, "q [N, H, D] over slots of a bf16 KV cache up to each token's position -> [N, H, D]");
  m.def("rope_attend", &slot_attention::rope_attend, nogil,
        "q [N, H, D], k/v [N, KVH, D]: RoPE, the K/V written into the cache, attention -> [N, H * D]");
  m.def("block_attend", &slot_attention::block_attend, nogil,
        "the draft's block attention: q [b, H, Q, D] over each row's context K/V [b, KVH, C, D] and its block's -> [b, H, Q, D]");
  m.attr("ATTEND_HEAD_DIMS") = slot_attention::head_dims();
  m.def("silu_mul", &activation::silu_mul, nogil, "bf16 gate_up [..., 2I] -> silu(gate) * up [..., I], rounded as torch's bf16 ops");
  m.def("argmax", &argmax::argmax, nogil, "bf16 rows [..., V] -> the first maximum's index (or first NaN's) [...], as torch.argmax");
  m.def("rms_norm", &rms_norm::rms_norm, nogil, "bf16 rows [..., H] -> weight * bf16(x * rsqrt(mean(x^2) + eps))");
  m.def("decoder_step", &decoder_layer::step, nogil,
        "a Llama/Qwen2 decoder layer over a step's tokens [..., H]: the lean loop's calls in one (decoder_layer.h)");
}
