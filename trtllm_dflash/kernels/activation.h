// The gated MLP's activation of bf16 rows in one call: silu(gate) * up from the fused gate/up projection's output,
// rounded as torch rounds `F.silu(gate) * up` in bf16 (silu in fp32 rounded to bf16, the product rounded again).
// Three torch ops and a split a layer, whose cost grows with the rows (docs/performance.md#activation-one-pass): one
// vector pass instead. silu's fp32 value may differ from torch's in its last bit
// (its own exp), which tips a bf16 rounding only rarely; a row's result never depends on the rows beside it.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "slot_attention.h"

namespace activation {

using slot_attention::kLanes;
using slot_attention::Vec;

#if defined(__AVX512F__)
inline __m512i bits(__m512 a) { return _mm512_castps_si512(a); }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.x, b.x)}; }
inline Vec neg_abs(Vec a) { return {_mm512_or_ps(a.x, _mm512_set1_ps(-0.0f))}; }
inline Vec if_nonnegative(Vec x, Vec yes, Vec no) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.x, _mm512_setzero_ps(), _CMP_GE_OQ), no.x, yes.x)}; }
inline __m512i rounded(__m512 a) {  // the nearest bf16's bits in the high half (ties to even; NaN stays a quiet NaN)
  const __m512i u = bits(a);
  const __m512i near = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), near, quiet);
}
inline Vec round_bf16(Vec a) { return {_mm512_castsi512_ps(_mm512_and_si512(rounded(a.x), _mm512_set1_epi32((int)0xFFFF0000u)))}; }
inline void store_bf16(uint16_t* p, Vec a) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded(a.x), 16))); }
#else
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec neg_abs(Vec a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(a.lo, sign), _mm256_or_ps(a.hi, sign)};
}
inline __m256 pick(__m256 x, __m256 yes, __m256 no) { return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)); }
inline Vec if_nonnegative(Vec x, Vec yes, Vec no) { return {pick(x.lo, yes.lo, no.lo), pick(x.hi, yes.hi, no.hi)}; }
inline __m256i rounded(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i near = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  return _mm256_blendv_epi8(near, quiet, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
inline __m256 round8(__m256 a) { return _mm256_castsi256_ps(_mm256_and_si256(rounded(a), _mm256_set1_epi32((int)0xFFFF0000u))); }
inline Vec round_bf16(Vec a) { return {round8(a.lo), round8(a.hi)}; }
inline void store_bf16(uint16_t* p, Vec a) {  // packus interleaves 128-bit lanes: the permute puts them back in order
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(rounded(a.lo), 16), _mm256_srli_epi32(rounded(a.hi), 16));
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(packed, 0xD8));
}
#endif

// silu(x) = x / (1 + e^-x), from e = e^-|x| (never overflows): x / (1 + e) for x >= 0, x e / (1 + e) below.
inline Vec silu(Vec x) {
  const Vec e = slot_attention::exp_nonpositive(neg_abs(x));
  return div(if_nonnegative(x, x, slot_attention::mul(x, e)), slot_attention::add(slot_attention::set1(1.f), e));
}

// gate_up [..., 2I] bf16 (gate, then up) -> [..., I] bf16; I a multiple of 16.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1, "silu_mul: bf16 rows");
  const int64_t I = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) == 2 * I && I % kLanes == 0, "silu_mul: rows of gate and up, each a multiple of 16 wide");
  const auto x = gate_up.contiguous();
  const int64_t rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {  // a step's few rows stay on the calling thread
    for (int64_t r = b; r < e; ++r)
      for (int64_t j = 0; j < I; j += kLanes) {
        const Vec s = round_bf16(silu(slot_attention::load_bf16(xp + r * 2 * I + j)));
        store_bf16(op + r * I + j, slot_attention::mul(s, slot_attention::load_bf16(xp + r * 2 * I + I + j)));
      }
  });
  return out;
}

}  // namespace activation
