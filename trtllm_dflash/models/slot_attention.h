// Attention of tokens on one flat axis over a static per-slot bf16 KV cache, for bf16 targets (included by both
// bf16 matrix kernel variants, compiled with each one's instruction set).
//
// Token t (query heads q[t], [H, D]) attends to positions 0..pos[t] of cache slot slot[t]: the cache already holds
// this forward's own K/V, so a verify block is causal by position and rows of any lengths share one call, with no
// mask and no padding. Every (token, head) is computed alone, in one fixed order (fp32 scores, max, exp, sum, the
// weighted sum of V, one rounding to bf16): a token's output does not depend on how many tokens or rows share the
// call, so a decode step, a verify block and a batch of rows give the same result (what bf16 lossless needs).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace slot_attention {

constexpr int kLanes = 16;  // partial sums per dot product: fixed, so the order never depends on the compiler

inline float widen(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t narrow(float f) {  // nearest even; NaN stays a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// q [N, H, D] bf16; k, v [S, KVH, C, D] bf16; slot, pos [N] int64 -> [N, H, D] bf16 (query head h reads K/V head
// h / (H / KVH), HF's repeat_kv order).
inline torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& slot, const torch::Tensor& pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "attend: q [N, H, D], k/v [S, KVH, C, D]");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16,
              "attend: bf16 tensors");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "attend: a contiguous cache");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), KVH = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(3) == D && D % kLanes == 0 && H % KVH == 0, "attend: head dim a multiple of 16, heads a multiple of KV heads");
  const auto qc = q.contiguous();
  const auto sl = slot.to(torch::kLong).contiguous(), ps = pos.to(torch::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S && pp[t] >= 0 && pp[t] < C, "attend: token ", t, " reads slot ", sp[t], " position ", pp[t],
                " outside the cache");
  auto out = torch::empty({N, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)qc.data_ptr();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const int64_t groups = H / KVH;
  const float sc = (float)scale;
  at::parallel_for(0, N * H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(D), acc(D), scores;
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / H, h = i % H, length = pp[t] + 1;
      const int64_t base = ((sp[t] * KVH + h / groups) * C) * D;
      for (int64_t d = 0; d < D; ++d) qf[d] = widen(qp[i * D + d]);
      scores.resize(length);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < length; ++j) {
        const uint16_t* kr = kp + base + j * D;
        float part[kLanes] = {0};
        for (int64_t d = 0; d < D; d += kLanes)
          for (int l = 0; l < kLanes; ++l) part[l] += qf[d + l] * widen(kr[d + l]);
        float dot = 0.f;
        for (int l = 0; l < kLanes; ++l) dot += part[l];
        scores[j] = dot * sc;
        top = std::max(top, scores[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < length; ++j) {
        scores[j] = std::exp(scores[j] - top);
        total += scores[j];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < length; ++j) {
        const uint16_t* vr = vp + base + j * D;
        const float p = scores[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += p * widen(vr[d]);
      }
      for (int64_t d = 0; d < D; ++d) op[i * D + d] = narrow(acc[d] / total);
    }
  });
  return out;
}

}  // namespace slot_attention
