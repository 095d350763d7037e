// Attention of tokens on one flat axis over a static per-slot bf16 KV cache, for bf16 targets (included by both
// bf16 matrix kernel variants, compiled with each one's instruction set: 16 fp32 lanes are one AVX-512 register or
// two AVX2 ones).
//
// Token t (query heads q[t], [H, D]) attends to positions 0..pos[t] of cache slot slot[t]: the cache already holds
// this forward's own K/V, so a verify block is causal by position and rows of any lengths share one call, with no
// mask and no padding. Every (token, head) is computed alone, in one fixed order (fp32 scores, max, exp, sum, the
// weighted sum of V, one rounding to bf16): a token's output does not depend on how many tokens or rows share the
// call, so a decode step, a verify block and a batch of rows give the same result (what bf16 lossless needs).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace slot_attention {

constexpr int kLanes = 16;  // fp32 lanes of a Vec: partial sums per dot product, the same on both instruction sets

#if defined(__AVX512F__)
struct Vec {
  __m512 x;
};
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float a) { return {_mm512_set1_ps(a)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.x); }
inline Vec load_bf16(const uint16_t* p) {  // 16 bf16 -> fp32: the high half of each word
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.x, b.x)}; }
inline Vec sub(Vec a, Vec b) { return {_mm512_sub_ps(a.x, b.x)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.x, b.x)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.x, b.x)}; }
inline Vec round(Vec a) { return {_mm512_roundscale_ps(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec pow2(Vec p, Vec n) { return {_mm512_scalef_ps(p.x, n.x)}; }  // p * 2^n, n integral
inline float sum(Vec a) {  // fixed tree: halves added until one lane is left
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.x), _mm512_extractf32x8_ps(a.x, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  __m256 lo, hi;
};
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline Vec load_bf16(const uint16_t* p) { return {widen8(p), widen8(p + 8)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec round(Vec a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m256 pow2_8(__m256 p, __m256 n) {  // n in [-126, 0] here (exp's argument is clamped): a normal 2^n
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline Vec pow2(Vec p, Vec n) { return {pow2_8(p.lo, n.lo), pow2_8(p.hi, n.hi)}; }
inline float sum(Vec a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#else
#error "slot_attention.h needs AVX-512F or AVX2 with FMA"
#endif

// exp(x) for x <= 0 (a score minus the row's maximum): x = n ln2 + r, |r| <= ln2/2, e^r by its degree-6 Taylor
// polynomial (relative error about 2e-7, below fp32's own rounding of the sum it feeds), scaled by 2^n. Arguments
// below -87 give 2^-126 * e^r, not 0: weights of about 1e-38 against the maximum's 1.
inline Vec exp_nonpositive(Vec x) {
  x = max(x, set1(-87.0f));
  const Vec n = round(mul(x, set1(1.44269504088896341f)));
  Vec r = fma(n, set1(-0.693145751953125f), x);  // ln 2 in two parts: the first exact in n's product
  r = fma(n, set1(-1.428606765330187e-06f), r);
  Vec p = set1(1.f / 720);
  p = fma(p, r, set1(1.f / 120));
  p = fma(p, r, set1(1.f / 24));
  p = fma(p, r, set1(1.f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.f));
  p = fma(p, r, set1(1.f));
  return pow2(p, n);
}

inline uint16_t narrow(float f) {  // nearest even; NaN stays a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Rows of keys and values: row j at k + j * kstride and v + j * vstride. A query attends to one or two such
// segments, scored as one sequence: a target step's slot of the cache, or the draft's context and its own block.
struct Keys {
  const uint16_t* k;
  const uint16_t* v;
  int64_t length, kstride, vstride;
};

// One token's G query heads that read one K/V head, D = 16 * CH: each K and V row is widened once for the G of them,
// and each head's arithmetic is the same sequence whatever G is. scores holds G rows of `sstride` floats, at least
// both segments' length + 16 (the exp pass runs over whole Vecs).
template <int CH, int G>
inline void attend_group(const uint16_t* q, Keys a, Keys b, int64_t sstride, float scale, float* scores, uint16_t* out) {
  constexpr int64_t D = CH * kLanes;
  const Keys segs[2] = {a, b};
  const int64_t length = a.length + b.length;
  Vec qv[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) qv[g][c] = mul(load_bf16(q + g * D + c * kLanes), set1(scale));
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  for (const Keys& s : segs)
    for (int64_t j = 0; j < s.length; ++j, ++at) {  // scores: 16 lane partial sums over the head dim, then their fixed tree
      Vec kr[CH];
      for (int c = 0; c < CH; ++c) kr[c] = load_bf16(s.k + j * s.kstride + c * kLanes);
      for (int g = 0; g < G; ++g) {
        Vec part = mul(qv[g][0], kr[0]);
        for (int c = 1; c < CH; ++c) part = fma(qv[g][c], kr[c], part);
        const float sc = sum(part);
        scores[g * sstride + at] = sc;
        top[g] = std::max(top[g], sc);
      }
    }
  const int64_t whole = (length + kLanes - 1) / kLanes * kLanes;
  float inv[G];
  for (int g = 0; g < G; ++g) {  // lanes past the length are zeroed after the exp
    float* sg = scores + g * sstride;
    for (int64_t j = length; j < whole; ++j) sg[j] = top[g];
    const Vec shift = set1(top[g]);
    for (int64_t j = 0; j < whole; j += kLanes) store(sg + j, exp_nonpositive(sub(load(sg + j), shift)));
    for (int64_t j = length; j < whole; ++j) sg[j] = 0.f;
    Vec total = zero();
    for (int64_t j = 0; j < whole; j += kLanes) total = add(total, load(sg + j));
    inv[g] = 1.f / sum(total);
  }
  Vec o[G][CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) o[g][c] = zero();
  at = 0;
  for (const Keys& s : segs)
    for (int64_t j = 0; j < s.length; ++j, ++at) {
      Vec vr[CH];
      for (int c = 0; c < CH; ++c) vr[c] = load_bf16(s.v + j * s.vstride + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const Vec p = set1(scores[g * sstride + at]);
        for (int c = 0; c < CH; ++c) o[g][c] = fma(p, vr[c], o[g][c]);
      }
    }
  alignas(64) float row[D];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < CH; ++c) store(row + c * kLanes, mul(o[g][c], set1(inv[g])));
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = narrow(row[d]);
  }
}

using GroupFn = void (*)(const uint16_t*, Keys, Keys, int64_t, float, float*, uint16_t*);

template <int CH>
inline GroupFn group_fn(int64_t g) {
  switch (g) {
    case 1: return attend_group<CH, 1>;
    case 2: return attend_group<CH, 2>;
    case 3: return attend_group<CH, 3>;
    default: return attend_group<CH, 4>;
  }
}

std::vector<int64_t> head_dims() { return {64, 128, 256}; }  // what `pick` compiles, for the Python side

inline GroupFn pick(int64_t head_dim, int64_t g) {
  switch (head_dim) {
    case 64: return group_fn<4>(g);
    case 128: return group_fn<8>(g);
    case 256: return group_fn<16>(g);
    default: return nullptr;
  }
}

// How a token's H query heads over KVH K/V heads of dim D are computed: `per` of a K/V head's `groups` query heads a
// call (each K/V row widened once for them), by `fn`.
struct Plan {
  GroupFn fn;
  int64_t groups, per;
};

inline Plan plan(int64_t H, int64_t KVH, int64_t D, const char* who) {
  TORCH_CHECK(KVH > 0 && H % KVH == 0, who, ": heads a multiple of KV heads");
  const int64_t groups = H / KVH;
  const int64_t per = groups % 4 == 0 ? 4 : groups % 3 == 0 ? 3 : groups % 2 == 0 ? 2 : 1;
  const GroupFn fn = pick(D, per);
  TORCH_CHECK(fn != nullptr, who, ": head dim 64, 128 or 256");
  return {fn, groups, per};
}

// q [N, H, D] bf16; k, v [S, KVH, C, D] bf16; slot, pos [N] int64 -> [N, H, D] bf16 (query head h reads K/V head
// h / (H / KVH), HF's repeat_kv order).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& slot, const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "attend: q [N, H, D], k/v [S, KVH, C, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "attend: bf16 tensors");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "attend: a contiguous cache");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), KVH = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(3) == D, "attend: the cache's head dim is not the queries'");
  const Plan p = plan(H, KVH, D, "attend");
  const GroupFn fn = p.fn;
  const int64_t groups = p.groups, per = p.per;
  const auto qc = q.contiguous();
  const auto sl = slot.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S && pp[t] >= 0 && pp[t] < C, "attend: token ", t, " reads slot ", sp[t], " position ", pp[t],
                " outside the cache");
  auto out = at::empty({N, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)qc.data_ptr();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const float sc = (float)scale;
  const int64_t calls = H / per;  // per token
  at::parallel_for(0, N * calls, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(per * (C + kLanes));
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / calls, h = i % calls * per;
      const int64_t base = ((sp[t] * KVH + h / groups) * C) * D;
      fn(qp + (t * H + h) * D, {kp + base, vp + base, pp[t] + 1, D, D}, {nullptr, nullptr, 0, D, D}, C + kLanes, sc, scores.data(),
         op + (t * H + h) * D);
    }
  });
  return out;
}

inline float widen(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x [D] rotated by RoPE at one position into out, rounding as torch's bf16 `x * cos + rotate_half(x) * sin` does
// (each product and the sum rounded to bf16): the same bits as the unfused ops, so prompts written by the Hugging
// Face path and steps written here share one cache.
inline void rope(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -widen(x[d + half]) : widen(x[d - half]);
    const float a = widen(narrow(widen(x[d]) * widen(cos[d]))), b = widen(narrow(rot * widen(sin[d])));
    out[d] = narrow(a + b);
  }
}

// A step's attention from its projections: q [N, H, D], k, v [N, KVH, D] (each token's heads contiguous, tokens at
// any stride: views of the fused QKV output), cos, sin [N, D]. Rotates k and writes it and v into the cache at each
// token's slot and position, then attends as `attend` does with q rotated. -> [N, H * D]. One call for what took
// about twenty torch ops a layer (views, RoPE, the cache writes, the layout for `attend`).
at::Tensor rope_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, at::Tensor kc, at::Tensor vc, const at::Tensor& slot,
                       const at::Tensor& pos, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && kc.dim() == 4 && vc.sizes() == kc.sizes(),
              "rope_attend: q [N, H, D], k/v [N, KVH, D], caches [S, KVH, C, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "rope_attend: bf16 tensors");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), S = kc.size(0), KVH = kc.size(1), C = kc.size(2);
  TORCH_CHECK(k.size(0) == N && k.size(1) == KVH && k.size(2) == D && kc.size(3) == D && D % 2 == 0, "rope_attend: shapes disagree");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "rope_attend: each token's heads contiguous");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "rope_attend: a contiguous cache");
  const auto cs = cos.reshape({N, D}).contiguous(), sn = sin.reshape({N, D}).contiguous();
  const auto sl = slot.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S && pp[t] >= 0 && pp[t] < C, "rope_attend: token ", t, " writes slot ", sp[t], " position ",
                pp[t], " outside the cache");
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  const uint16_t* cp = (const uint16_t*)cs.data_ptr();
  const uint16_t* np = (const uint16_t*)sn.data_ptr();
  uint16_t* kcp = (uint16_t*)kc.data_ptr();
  uint16_t* vcp = (uint16_t*)vc.data_ptr();
  for (int64_t t = 0; t < N; ++t)  // every write before any read: a verify block's tokens attend to each other
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t at = ((sp[t] * KVH + h) * C + pp[t]) * D;
      rope(kp + t * k.stride(0) + h * D, cp + t * D, np + t * D, D, kcp + at);
      std::memcpy(vcp + at, vp + t * v.stride(0) + h * D, D * sizeof(uint16_t));
    }
  auto qr = at::empty({N, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)q.data_ptr();
  uint16_t* qrp = (uint16_t*)qr.data_ptr();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < H; ++h) rope(qp + t * q.stride(0) + h * D, cp + t * D, np + t * D, D, qrp + (t * H + h) * D);
  return attend(qr, kc, vc, slot, pos, scale).view({N, H * D});
}

// The DFlash draft's block attention (kernels.py: `block_attention`, its contract): row i's Q block queries attend to
// its context K/V up to ctx_lens[i], then to the block's own K/V, all of it (causal: up to their own). q [b, H, Q, D];
// k, v [b, KVH, Q, D]; ctx_k, ctx_v [b, KVH, C, D]; rows of D contiguous, any other strides (views of the draft's
// cache and of its fused QKV output are read in place) -> [b, H, Q, D], a view of a [b, Q, H, D] tensor (the layout
// the output projection reads). No mask is built and the context is not copied beside the block.
at::Tensor block_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& ctx_k,
                        const at::Tensor& ctx_v, const at::Tensor& ctx_lens, bool causal, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && ctx_k.dim() == 4 && v.sizes() == k.sizes() && ctx_v.sizes() == ctx_k.sizes(),
              "block_attend: q [b, H, Q, D], k/v [b, KVH, Q, D], ctx_k/ctx_v [b, KVH, C, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &ctx_k, &ctx_v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(3) == 1, "block_attend: bf16 tensors, rows of D contiguous");
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3), KVH = k.size(1), C = ctx_k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(2) == Q && k.size(3) == D && ctx_k.size(0) == B && ctx_k.size(1) == KVH && ctx_k.size(3) == D,
              "block_attend: shapes disagree");
  const Plan p = plan(H, KVH, D, "block_attend");
  const GroupFn fn = p.fn;
  const int64_t groups = p.groups, per = p.per;
  const auto lens = ctx_lens.to(at::kLong).contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  TORCH_CHECK(lens.numel() == B, "block_attend: one context length per row");
  for (int64_t i = 0; i < B; ++i) TORCH_CHECK(lp[i] >= 0 && lp[i] <= C, "block_attend: row ", i, " has context length ", lp[i], " outside [0, ", C, "]");
  const auto qc = q.transpose(1, 2).contiguous();  // [b, Q, H, D]: a token's heads side by side (free for the draft's q)
  auto out = at::empty({B, Q, H, D}, q.options());
  const uint16_t* qp = (const uint16_t*)qc.data_ptr();
  const uint16_t* kp = (const uint16_t*)k.data_ptr();
  const uint16_t* vp = (const uint16_t*)v.data_ptr();
  const uint16_t* ckp = (const uint16_t*)ctx_k.data_ptr();
  const uint16_t* cvp = (const uint16_t*)ctx_v.data_ptr();
  uint16_t* op = (uint16_t*)out.data_ptr();
  const float sc = (float)scale;
  const int64_t calls = H / per;  // per token
  at::parallel_for(0, B * Q * calls, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(per * (C + Q + kLanes));
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t row = i / (Q * calls), t = i / calls % Q, h = i % calls * per, kvh = h / groups;
      const Keys context{ckp + row * ctx_k.stride(0) + kvh * ctx_k.stride(1), cvp + row * ctx_v.stride(0) + kvh * ctx_v.stride(1), lp[row],
                         ctx_k.stride(2), ctx_v.stride(2)};
      const Keys block{kp + row * k.stride(0) + kvh * k.stride(1), vp + row * v.stride(0) + kvh * v.stride(1), causal ? t + 1 : Q,
                       k.stride(2), v.stride(2)};
      const int64_t at = ((row * Q + t) * H + h) * D;
      fn(qp + at, context, block, C + Q + kLanes, sc, scores.data(), op + at);
    }
  });
  return out.transpose(1, 2);
}

}  // namespace slot_attention
