// One decoder layer of a step in one call: a Llama or Qwen2 layer over a step's tokens on one axis (RMSNorm, the
// fused q/k/v projection, RoPE with the cache writes and attention, o, the residual, RMSNorm, the fused gate/up
// projection, silu(gate) * up, down, the residual). TargetModel._lean_forward made these calls, and the views and
// splits between them, from Python: about twenty Python calls a layer, each kernel call giving up the GIL and taking
// it back. Here they are the same functions in the same order on the same arguments, so the same bits.
#pragma once
#include <ATen/core/Tensor.h>

#include "kernels.h"

namespace decoder_layer {

// A projection's weights as the layer's PackedLinear holds them: packed bf16, or 4-bit records (uint8).
inline at::Tensor project(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  return w.scalar_type() == at::kByte ? linear_q4(x, w, bias) : linear(x, w, bias);
}

// x [..., H] (a step's N tokens); qkv, o, gate_up, down packed as `linear` or `linear_q4` takes them; q_heads and kv_heads of the
// fused projection's output; cos/sin, the caches, slot and pos as `rope_attend` takes them.
at::Tensor step(const at::Tensor& x, const at::Tensor& input_norm, double input_eps, const at::Tensor& qkv,
                const c10::optional<at::Tensor>& qkv_bias, int64_t q_heads, int64_t kv_heads, const at::Tensor& cos,
                const at::Tensor& sin, at::Tensor kc, at::Tensor vc, const at::Tensor& slot, const at::Tensor& pos,
                double scale, const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
                double post_eps, const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_bias,
                const at::Tensor& down, const c10::optional<at::Tensor>& down_bias) {
  const auto heads = project(rms_norm::rms_norm(x, input_norm, input_eps), qkv, qkv_bias)
                         .view({-1, q_heads + 2 * kv_heads, kc.size(3)});  // [N, q + 2 kv heads, D]
  const auto qkv_heads = heads.split_with_sizes({q_heads, kv_heads, kv_heads}, 1);
  const auto attended = slot_attention::rope_attend(qkv_heads[0], qkv_heads[1], qkv_heads[2], cos, sin, kc, vc, slot,
                                                    pos, scale);  // [N, q heads * D]
  auto sizes = x.sizes().vec();
  sizes.back() = -1;
  const auto h = x.add(project(attended.reshape(sizes), o, o_bias));
  const auto gated = activation::silu_mul(project(rms_norm::rms_norm(h, post_norm, post_eps), gate_up, gate_up_bias));
  return h.add(project(gated, down, down_bias));
}

}  // namespace decoder_layer
