// y = x W^T (+ bias) for W held in 4 bits, as a GGUF Q4_1 target ships it: per output and block of 32 inputs, a scale d
// and a minimum m (fp16) and 32 codes q in 0..15, the weight d * q + m. Included at the end of each variant's kernel
// file (bf16_gemm.cpp, bf16_gemm_avx2.cpp), whose row loop it reuses.
//
// Why: a decode step streams every weight once, so at a few rows its time is the weights' bytes over memory bandwidth.
// bf16 weights are 2 bytes each; these are 0.625 (a code, and d and m per 32).
//
// Layout (bf16_gemm.py: pack_q4), per block of 32 outputs and block of 32 inputs, a record of 640 bytes:
//   d[32], m[32]            fp16, one per output
//   16 lines x 32 bytes     line l, byte j: output j's code for input 2l (low nibble) and for input 2l + 1 (high)
// so records are [N/32][K/32][640], read in the order the bf16 layout's lines are.
//
// Invariant: a row's output has the same bits as `linear` on the bf16 weights bf16(d * q + m) (fp32 arithmetic, d * q
// exact, one rounding at + m, then nearest-even to bf16: the dequantization a GGUF conversion does, then the cast to
// bf16). Each line of a record is decoded once into those bf16 weights, shared by every row of the call (the AVX-512
// variant in registers, the AVX2 one into 2 KB of lines held in L1), and the variant's own row arithmetic runs over
// them in the same order as over the packed bf16 weights.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace q4 {

constexpr int64_t kInputs = 32;                // inputs per record
constexpr int64_t kLines = kInputs / 2;        // bf16 lines (input pairs) a record decodes to
constexpr int64_t kScaleBytes = 2 * 32 * 2;    // d[32] and m[32], fp16
constexpr int64_t kRecord = kScaleBytes + kLines * 32;
constexpr int64_t kPrefetchRecords = 2;        // records asked for ahead of the one decoded

#if defined(__AVX512BF16__)
// A record's scales, d and m for outputs 0-15 and 16-31, widened to fp32 once for its 16 lines.
struct Scales {
  __m512 d0, d1, m0, m1;
};

inline Scales scales_of(const uint8_t* rec) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec)),
          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32))),
          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 64))),
          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 96)))};
}

// Line l of a record as bf16_blocks.h lays a line out: 32 outputs x inputs (2l, 2l + 1), outputs 0-15 in w0.
inline void decode_line(const uint8_t* rec, const Scales& s, int64_t l, __m512bh& w0, __m512bh& w1) {
  // [e0..e15, o0..o15] -> [e0, o0, e1, o1, ...]: each output's pair of inputs side by side
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i low = _mm512_set1_epi32(0xF);
  const uint8_t* codes = rec + kScaleBytes + 32 * l;
  for (int h = 0; h < 2; ++h) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16 * h)));
    const __m512 d = h ? s.d1 : s.d0, m = h ? s.m1 : s.m0;
    const __m512 e = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), d, m);
    const __m512 o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, m);
    (h ? w1 : w0) = (__m512bh)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(o, e));
  }
}

// Rows x[0..M) times blocks nb..nb+B-1 (block b's records at w + b * stride): block_rows's arithmetic (bf16_gemm.cpp),
// instruction for instruction, each line decoded in registers once for all M rows.
template <int M, int B>
void block_rows(const uint16_t* x, const uint8_t* w, int64_t stride, const float* bias, uint16_t* y, int64_t N, int64_t K,
                int64_t nb) {
  __m512 acc[B][2][M];
  for (int b = 0; b < B; ++b)
    for (int m = 0; m < M; ++m) acc[b][0][m] = acc[b][1][m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / kInputs; ++kb) {
    const uint8_t* rec[B];
    Scales scales[B];
    for (int b = 0; b < B; ++b) {
      rec[b] = w + b * stride + kb * kRecord;
      for (int64_t i = 0; i < kRecord; i += 64) _mm_prefetch((const char*)rec[b] + kPrefetchRecords * kRecord + i, _MM_HINT_T0);
      scales[b] = scales_of(rec[b]);
    }
    for (int64_t l = 0; l < kLines; ++l) {
      const int64_t kp = kb * kLines + l;
      __m512bh xb[M];
      for (int m = 0; m < M; ++m) xb[m] = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + m * K + 2 * kp));
      for (int b = 0; b < B; ++b) {
        __m512bh w0, w1;
        decode_line(rec[b], scales[b], l, w0, w1);
        for (int m = 0; m < M; ++m) {
          acc[b][0][m] = _mm512_dpbf16_ps(acc[b][0][m], xb[m], w0);
          acc[b][1][m] = _mm512_dpbf16_ps(acc[b][1][m], xb[m], w1);
        }
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t out = (nb + b) * bf16_blocks::kBlock;
    for (int m = 0; m < M; ++m) {
      __m512 a0 = acc[b][0][m], a1 = acc[b][1][m];
      if (bias) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(bias + out));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(bias + out + 16));
      }
      _mm256_storeu_si256((__m256i*)(y + m * N + out), (__m256i)_mm512_cvtneps_pbh(a0));
      _mm256_storeu_si256((__m256i*)(y + m * N + out + 16), (__m256i)_mm512_cvtneps_pbh(a1));
    }
  }
}

template <int M>
void blocks(int nbs, const uint16_t* x, const uint8_t* w, int64_t stride, const float* bias, uint16_t* y, int64_t N,
            int64_t K, int64_t nb) {
  constexpr int B = blocks_per_pass(M);
  if constexpr (B >= 4) if (nbs == 4) return block_rows<M, 4>(x, w, stride, bias, y, N, K, nb);
  if constexpr (B >= 3) if (nbs == 3) return block_rows<M, 3>(x, w, stride, bias, y, N, K, nb);
  if constexpr (B >= 2) if (nbs == 2) return block_rows<M, 2>(x, w, stride, bias, y, N, K, nb);
  return block_rows<M, 1>(x, w, stride, bias, y, N, K, nb);
}

// m rows (1..kRows) of blocks nb..nb+nbs-1, as `rows` in bf16_gemm.cpp.
inline void rows(int m, int nbs, const uint16_t* x, const uint8_t* w, const float* bias, uint16_t* y, int64_t N,
                 int64_t K, int64_t nb) {
  const int64_t stride = K / kInputs * kRecord;
  switch (m) {
    case 1: return blocks<1>(nbs, x, w, stride, bias, y, N, K, nb);
    case 2: return blocks<2>(nbs, x, w, stride, bias, y, N, K, nb);
    case 3: return blocks<3>(nbs, x, w, stride, bias, y, N, K, nb);
    case 4: return blocks<4>(nbs, x, w, stride, bias, y, N, K, nb);
    case 5: return blocks<5>(nbs, x, w, stride, bias, y, N, K, nb);
    case 6: return blocks<6>(nbs, x, w, stride, bias, y, N, K, nb);
    case 7: return blocks<7>(nbs, x, w, stride, bias, y, N, K, nb);
    default: return blocks<8>(nbs, x, w, stride, bias, y, N, K, nb);
  }
}
using XT = uint16_t;  // the inputs as the variant's row loop takes them: bf16
constexpr int kRowsPerGroup = kRows;
#else
// 8 fp32 lanes rounded to bf16 as store_bf16 rounds them (nearest even, a NaN kept quiet), left in each lane's top half.
inline __m256i bf16_high(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_set1_epi32((int)0xFFFF0000);
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), top);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_and_si256(u, top), _mm256_set1_epi32(0x400000)), nan);
}

// One record -> 16 lines of bf16 weights (the AVX2 variant's fp32 arithmetic widens them again, exactly).
inline void decode(const uint8_t* rec, uint16_t* lines) {
  __m256 d[4], m[4];
  for (int g = 0; g < 4; ++g) {
    d[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16 * g)));
    m[g] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 64 + 16 * g)));
  }
  const __m256i low = _mm256_set1_epi32(0xF);
  const uint8_t* codes = rec + kScaleBytes;
  for (int64_t l = 0; l < kLines; ++l, codes += 32, lines += 64) {
    for (int g = 0; g < 4; ++g) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 8 * g)));
      const __m256 e = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), d[g], m[g]);
      const __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), d[g], m[g]);
      // each output's pair: the even input's bf16 in the low half, the odd one's in the high half
      const __m256i pair = _mm256_or_si256(_mm256_srli_epi32(bf16_high(e), 16), bf16_high(o));
      _mm256_store_si256((__m256i*)(lines + 16 * g), pair);
    }
  }
}

// m rows of one block: `rows`'s arithmetic in bf16_gemm_avx2.cpp (pass over each record's decoded lines, the sums of
// two rows at a time carried from record to record in `sums`), so the same order of additions per output.
inline void rows(int m, int, const float* x, const uint8_t* w, const float* bias, uint16_t* y, int64_t N, int64_t K,
                 int64_t nb) {
  alignas(32) uint16_t lines[kLines * 64];
  alignas(32) float sums[kGroup][kBlock];
  for (int64_t kb = 0; kb < K / kInputs; ++kb) {
    const uint8_t* rec = w + kb * kRecord;
    for (int64_t i = 0; i < kRecord; i += 64) _mm_prefetch((const char*)rec + kPrefetchRecords * kRecord + i, _MM_HINT_T0);
    decode(rec, lines);
    const int64_t kp0 = kb * kLines;
    for (int m0 = 0; m0 < m; m0 += 2) {
      const int r = std::min(2, m - m0);
      __m256 acc[2][4];
      for (int i = 0; i < r; ++i)
        for (int g = 0; g < 4; ++g) acc[i][g] = kb ? _mm256_load_ps(sums[m0 + i] + 8 * g) : _mm256_setzero_ps();
      if (r == 2) pass<2>(x + m0 * K, lines, *reinterpret_cast<__m256(*)[2][4]>(&acc), K, kp0, kp0 + kLines, 0);
      else pass<1>(x + m0 * K, lines, *reinterpret_cast<__m256(*)[1][4]>(&acc), K, kp0, kp0 + kLines, 0);
      for (int i = 0; i < r; ++i)
        for (int g = 0; g < 4; ++g) _mm256_store_ps(sums[m0 + i] + 8 * g, acc[i][g]);
    }
  }
  for (int r = 0; r < m; ++r) {
    __m256 acc[4];
    for (int g = 0; g < 4; ++g) acc[g] = _mm256_load_ps(sums[r] + 8 * g);
    store_row(acc, nullptr, bias, y + r * N, nb);
  }
}
using XT = float;  // the inputs as the variant's row loop takes them: widened to fp32 once
constexpr int kRowsPerGroup = kGroup;
#endif

}  // namespace q4

// y = x W^T (+ bias) for W as q4 records [N/32, K/32, 640] (uint8); x bf16.
at::Tensor linear_q4(const at::Tensor& x, const at::Tensor& records, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && records.scalar_type() == at::kByte && records.dim() == 3 &&
                  records.size(2) == q4::kRecord && records.is_contiguous(),
              "linear_q4: bf16 x and uint8 records [N/32, K/32, 640]");
  const int64_t N = records.size(0) * bf16_blocks::kBlock, K = records.size(1) * q4::kInputs;
  TORCH_CHECK(x.size(-1) == K, "linear_q4: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()), "linear_q4: an fp32 bias");
  const uint8_t* wp = records.data_ptr<uint8_t>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t stride = K / q4::kInputs * q4::kRecord;  // one block's records
  // the shared loop's pointer arithmetic is in bf16 lines; pass each block's records instead
  auto rows = [wp, stride](int m, int nbs, const q4::XT* x, const uint16_t*, const float* bias, uint16_t* y, int64_t N,
                           int64_t K, int64_t nb) { q4::rows(m, nbs, x, wp + nb * stride, bias, y, N, K, nb); };
#if defined(__AVX512BF16__)
  const int group = (int)std::clamp<int64_t>(x.numel() / K, 1, kRows);
  return bf16_blocks::run<q4::XT, q4::kRowsPerGroup>(x, N, K, (const uint16_t*)nullptr, bp, rows, blocks_per_pass(group));
#else
  return bf16_blocks::run<q4::XT, q4::kRowsPerGroup>(x, N, K, (const uint16_t*)nullptr, bp, rows);
#endif
}
