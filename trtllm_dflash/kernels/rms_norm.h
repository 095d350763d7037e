// RMSNorm of bf16 rows (Llama, Qwen2 and Qwen3's: weight * bf16(x * rsqrt(mean(x^2) + eps))) in one call, for bf16
// targets' lean forward: the Hugging Face module is seven torch ops (casts, pow, mean, add, rsqrt, two products), 61
// times in a 30-layer forward. Computed as the module computes it, in fp32 with each product rounded to bf16 where
// torch rounds it; the sum of squares runs over 16 lanes in a fixed order (torch's own order is its kernel's), so a
// row's result does not depend on the rows beside it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include <cmath>

#include "slot_attention.h"

namespace rms_norm {

using slot_attention::kLanes;
using slot_attention::narrow;
using slot_attention::widen;

// x [..., H] bf16, weight [H] bf16 -> [..., H] bf16; H a multiple of 16. A weight [G, H] scales x [..., G, H] row by
// row (the draft's query and key heads, each kind with its own norm, in one call).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm: bf16 tensors");
  const int64_t H = x.size(-1), G = weight.dim() == 2 ? weight.size(0) : 1;
  TORCH_CHECK(weight.size(-1) == H && H % kLanes == 0 && (weight.dim() == 1 || (weight.dim() == 2 && x.dim() >= 2 && x.size(-2) == G)),
              "rms_norm: weight [H] or [G, H] for x [..., G, H], H a multiple of 16");
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t rows = xc.numel() / H;
  auto out = at::empty_like(xc);
  const uint16_t* xp = (const uint16_t*)xc.data_ptr();
  const uint16_t* wp = (const uint16_t*)wc.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {  // a step's few rows stay on the calling thread
    for (int64_t r = b; r < e; ++r) {
      const uint16_t* xr = xp + r * H;
      slot_attention::Vec acc = slot_attention::zero();
      for (int64_t d = 0; d < H; d += kLanes) {
        const slot_attention::Vec v = slot_attention::load_bf16(xr + d);
        acc = slot_attention::fma(v, v, acc);
      }
      const float scale = 1.f / std::sqrt(slot_attention::sum(acc) / (float)H + (float)eps);
      const uint16_t* wr = wp + r % G * H;
      for (int64_t d = 0; d < H; ++d) op[r * H + d] = narrow(widen(wr[d]) * widen(narrow(widen(xr[d]) * scale)));
    }
  });
  return out;
}

}  // namespace rms_norm
