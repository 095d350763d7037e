// The entry points of our CPU kernel module, declared apart from their definitions (bf16_gemm.cpp or
// bf16_gemm_avx2.cpp and the headers they include) so that bindings.cpp, whose torch and pybind11 headers take half of
// a build, compiles on one core while the kernels compile on the other; the kernels include ATen's tensor and factory
// headers alone, not torch/extension.h, which alone compiles for longer than the whole module now does. A first build
// takes about a third of the time it took with the bindings in the kernel's file and torch/extension.h everywhere,
// with the same bits from every function of every variant (docs/performance.md#bf16-kernel-compile).
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace bf16_blocks {
at::Tensor pack(const at::Tensor& weight);
}
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& records, const c10::optional<at::Tensor>& bias);
#ifdef TRTDFLASH_INT8
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias);
#endif
namespace slot_attention {
std::vector<int64_t> head_dims();
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot,
                  const at::Tensor& pos, double scale);
at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor kc, at::Tensor vc, const at::Tensor& slot, const at::Tensor& pos,
                       double scale);
at::Tensor block_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx_k,
                        const at::Tensor& ctx_v, const at::Tensor& ctx_lens, bool causal, double scale);
}  // namespace slot_attention
namespace activation {
at::Tensor silu_mul(const at::Tensor& gate_up);
}
namespace argmax {
at::Tensor argmax(const at::Tensor& x);
}
namespace rms_norm {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
}
namespace decoder_layer {
at::Tensor step(const at::Tensor& x, const at::Tensor& input_norm, double input_eps, const at::Tensor& qkv,
                const c10::optional<at::Tensor>& qkv_bias, int64_t q_heads, int64_t kv_heads, const at::Tensor& cos,
                const at::Tensor& sin, at::Tensor kc, at::Tensor vc, const at::Tensor& slot, const at::Tensor& pos,
                double scale, const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
                double post_eps, const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                const at::Tensor& down, const c10::optional<at::Tensor>& down_bias);
}
