// Greedy decoding's argmax over bf16 logits rows in one vectorized call. ATen's CPU argmax reduces the last dim one
// element at a time, slower in bf16 than after a cast to fp32 (docs/performance.md#greedy-argmax), on every step of
// plain decoding and DFlash alike. The result is torch's: the first maximum of a row, or its first NaN where it has one.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include <cmath>
#include <limits>

#include "slot_attention.h"

namespace argmax {

using slot_attention::kLanes;
using slot_attention::load_bf16;
using slot_attention::Vec;
using slot_attention::widen;

#if defined(__AVX512F__)
inline uint32_t equal_lanes(Vec a, float b) { return _mm512_cmp_ps_mask(a.x, _mm512_set1_ps(b), _CMP_EQ_OQ); }
inline uint32_t nan_lanes(Vec a) { return _mm512_cmp_ps_mask(a.x, a.x, _CMP_UNORD_Q); }
inline float top(Vec a) { return _mm512_reduce_max_ps(a.x); }
#else
inline uint32_t lanes(__m256 lo, __m256 hi) { return (uint32_t)_mm256_movemask_ps(lo) | ((uint32_t)_mm256_movemask_ps(hi) << 8); }
inline uint32_t equal_lanes(Vec a, float b) {
  const __m256 s = _mm256_set1_ps(b);
  return lanes(_mm256_cmp_ps(a.lo, s, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, s, _CMP_EQ_OQ));
}
inline uint32_t nan_lanes(Vec a) { return lanes(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }
inline float top(Vec a) {
  alignas(32) float f[kLanes];
  slot_attention::store(f, a);
  float m = f[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, f[i]);
  return m;
}
#endif

// The first index whose lanes `hit` marks, scanning whole Vecs then the tail one element at a time.
template <typename Hit, typename HitOne>
inline int64_t first(const uint16_t* p, int64_t V, Hit hit, HitOne hit_one) {
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    if (const uint32_t m = hit(load_bf16(p + j))) return j + __builtin_ctz(m);
  for (; j < V; ++j)
    if (hit_one(widen(p[j]))) return j;
  return -1;
}

inline int64_t row(const uint16_t* p, int64_t V) {
  Vec best = slot_attention::set1(-std::numeric_limits<float>::infinity());
  uint32_t nan = 0;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const Vec v = load_bf16(p + j);
    nan |= nan_lanes(v);
    best = slot_attention::max(best, v);
  }
  float m = top(best);
  for (; j < V; ++j) {
    const float f = widen(p[j]);
    nan |= f != f;
    m = std::max(m, f);
  }
  if (nan) return first(p, V, nan_lanes, [](float f) { return f != f; });
  return first(p, V, [m](Vec v) { return equal_lanes(v, m); }, [m](float f) { return f == m; });
}

// x [..., V] bf16 -> [...] int64.
at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) > 0, "argmax: bf16 rows of at least one value");
  const auto xc = x.contiguous();
  const int64_t V = xc.size(-1), rows = xc.numel() / V;
  auto out = at::empty(xc.sizes().slice(0, xc.dim() - 1), xc.options().dtype(at::kLong));
  const uint16_t* xp = (const uint16_t*)xc.data_ptr();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = row(xp + r * V, V);
  });
  return out;
}

}  // namespace argmax
