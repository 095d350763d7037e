// y = x W^T (+ bias) for bf16 x [M, K] and W [N, K] on CPUs with AVX2 and FMA but no bf16 arithmetic, from W packed
// as bf16_blocks.h packs it: [N/32][K/2][32][2]. bf16 weights (half of fp32's bytes to stream), fp32 arithmetic.
//
// Why (figures in bf16_gemm.py): where bf16 matrix products are emulated, torch's bf16 linear for 8 tokens cost
// several times one token's, and fp32 streams twice the bytes. Here each weight pair is widened to fp32 in registers
// (a bf16 is the top half of an fp32) and multiplied with FMA. Every output is one fp32 accumulator over the inputs
// in order (k = 0, 1, 2, ...), rounded once to bf16 (nearest even), whatever M is and wherever the row sits: a row's
// result does not depend on the rows beside it (batch-invariant). The bias comes in fp32.
//
// The same loop multiplies int8 weights with a scale per output (`linear_int8`: a draft's, bf16_gemm.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "bf16_blocks.h"
#include "rms_norm.h"
#include "activation.h"
#include "argmax.h"
#include "slot_attention.h"
#include "decoder_layer.h"

namespace {

using bf16_blocks::kBlock;  // outputs per block: 4 x 8 lanes

// Nearest-even fp32 -> bf16 of 8 lanes (NaN stays a quiet NaN), stored as 8 x uint16.
inline void store_bf16(uint16_t* dst, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  _mm_storeu_si128((__m128i*)dst, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// A single pass asks for the weights 1 KB ahead of the ones it multiplies: on a 2-core AMD EPYC Zen 3 the hardware
// prefetcher alone left SmolLM2's linears 10-20 % slower for 2-16 rows, and 1 KB ahead beat 4 KB for one row
// (docs/performance.md#bf16-kernel-avx2-prefetch).
constexpr int64_t kPrefetchBytes = 1024;
// More than two rows take a block in chunks of 4 KB of weights (held in L1): every pair of rows passes over a chunk
// before the next one, its sums parked in memory between chunks, and the first pass asks for the weights
// kGroupPrefetchBytes ahead, so memory streams the next chunk while the other pairs compute. Passes over a whole block
// in turn left memory idle after the first: SmolLM2's linears took 35.8 ms for 4 rows and 51.8 for 8 that way, 27.6
// and 41.1 in chunks, 28.4 for one row (one Zen 3 thread, benchmarks/results/bf16-kernel-zen3-avx2-chunks-1thread-20261128.json).
constexpr int64_t kChunkBytes = 4096;
constexpr int64_t kGroupPrefetchBytes = 4096;
constexpr int kGroup = 16;  // rows that share one stream of a block (more take it again, from cache)

// Outputs 8g..8g+7's weights for inputs 2kp (e) and 2kp + 1 (o) of a line, widened to fp32. bf16: 32 pairs
// (w[o][2kp], w[o][2kp + 1]), each a bf16 in half an fp32.
inline void widen(const uint16_t* line, int g, __m256& e, __m256& o) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)(line + 16 * g));
  e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)));
}

// int8 (pack_int8's layout): the 32 outputs' weights for input 2kp, then theirs for 2kp + 1.
inline void widen(const int8_t* line, int g, __m256& e, __m256& o) {
  e = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(line + 8 * g))));
  o = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(line + 32 + 8 * g))));
}

// Rows x[0..M) (fp32, [M, K]) times the 32 outputs of a block, weight pairs [kp0, kp1) of it (`line`: pair kp0's line
// of 64 weights), into acc: each line read whole, in order. Per group of 8 outputs the even weights are multiplied
// into every row, then the odd ones: the inputs are broadcast from memory where used rather than held, which leaves
// the registers to the 4M accumulators. Each accumulator adds its inputs in order k = 2 kp0, 2 kp0 + 1, ...
template <int M, typename WT>
inline void pass(const float* x, const WT* line, __m256 (&acc)[M][4], int64_t K, int64_t kp0, int64_t kp1, int64_t prefetch) {
  const float* xk = x + 2 * kp0;  // inputs 2kp and 2kp + 1 of row 0
  for (int64_t kp = kp0; kp < kp1; ++kp, line += 64, xk += 2) {
    if (prefetch)
      for (int b = 0; b < (int)sizeof(WT); ++b) _mm_prefetch((const char*)line + prefetch + 64 * b, _MM_HINT_T0);
    for (int g = 0; g < 4; ++g) {
      __m256 e, o;
      widen(line, g, e, o);
      for (int m = 0; m < M; ++m) acc[m][g] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(xk + m * K), acc[m][g]);
      for (int m = 0; m < M; ++m) acc[m][g] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(xk + m * K + 1), acc[m][g]);
    }
  }
}

// The block's outputs of one row: times the per-output scale (int8 weights; none for bf16), plus the bias, rounded.
inline void store_row(const __m256 (&acc)[4], const float* scale, const float* bias, uint16_t* y, int64_t nb) {
  for (int g = 0; g < 4; ++g) {
    __m256 a = acc[g];
    if (scale) a = _mm256_mul_ps(a, _mm256_loadu_ps(scale + nb * kBlock + 8 * g));
    if (bias) a = _mm256_add_ps(a, _mm256_loadu_ps(bias + nb * kBlock + 8 * g));
    store_bf16(y + nb * kBlock + 8 * g, a);
  }
}

// One or two rows: one pass over the block, the sums in registers throughout.
template <int M, typename WT>
void block_rows(const float* x, const WT* w, const float* scale, const float* bias, uint16_t* y, int64_t N, int64_t K, int64_t nb) {
  __m256 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < 4; ++g) acc[m][g] = _mm256_setzero_ps();
  pass<M>(x, w, acc, K, 0, K / 2, kPrefetchBytes);
  for (int m = 0; m < M; ++m) store_row(acc[m], scale, bias, y + m * N, nb);
}

// A chunk for rows m0, m0 + 1 (or m0 alone), their sums taken from and returned to `sums` [kGroup][32].
template <int M, typename WT>
inline void chunk(const float* x, const WT* w, float (*sums)[kBlock], int m0, int64_t K, int64_t kp0, int64_t kp1) {
  __m256 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < 4; ++g) acc[m][g] = kp0 ? _mm256_load_ps(sums[m0 + m] + 8 * g) : _mm256_setzero_ps();
  pass<M>(x + m0 * K, w + kp0 * 64, acc, K, kp0, kp1, m0 ? 0 : kGroupPrefetchBytes);
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < 4; ++g) _mm256_store_ps(sums[m0 + m] + 8 * g, acc[m][g]);
}

template <typename WT>
void rows(int m, const float* x, const WT* w, const float* scale, const float* bias, uint16_t* y, int64_t N, int64_t K, int64_t nb) {
  if (m == 1) return block_rows<1>(x, w, scale, bias, y, N, K, nb);
  if (m == 2) return block_rows<2>(x, w, scale, bias, y, N, K, nb);
  constexpr int64_t kChunk = kChunkBytes / (64 * sizeof(WT));  // weight pairs a chunk
  alignas(32) float sums[kGroup][kBlock];
  for (int64_t kp0 = 0; kp0 < K / 2; kp0 += kChunk) {
    const int64_t kp1 = std::min<int64_t>(kp0 + kChunk, K / 2);
    for (int m0 = 0; m0 < m; m0 += 2) {
      if (m0 + 1 < m) chunk<2>(x, w, sums, m0, K, kp0, kp1);
      else chunk<1>(x, w, sums, m0, K, kp0, kp1);
    }
  }
  for (int r = 0; r < m; ++r) {
    __m256 acc[4];
    for (int g = 0; g < 4; ++g) acc[g] = _mm256_load_ps(sums[r] + 8 * g);
    store_row(acc, scale, bias, y + r * N, nb);
  }
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return bf16_blocks::linear<float, kGroup>(x, packed, bias, [](int m, int, const float* x, const uint16_t* w, const float* bias,
                                                                uint16_t* y, int64_t N, int64_t K, int64_t nb) {
    rows<uint16_t>(m, x, w, nullptr, bias, y, N, K, nb);
  });
}

// y = (x Q^T) * scale (+ bias) for int8 weights Q [N, K] with one fp32 scale per output, packed by bf16_gemm.pack_int8
// as [N/32][K/2][2][32]: per block and input pair, the 32 outputs' weights for the even input, then for the odd one.
// Half the bytes of bf16 to stream, the same fp32 arithmetic: for a draft's few rows, whose weights memory delivers
// more slowly than FMA consumes them.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kChar && packed.dim() == 4 &&
              packed.size(2) == 2 && packed.size(3) == kBlock && packed.is_contiguous(),
              "linear_int8: bf16 x and int8 weights packed [N/32, K/2, 2, 32]");
  const int64_t N = packed.size(0) * kBlock, K = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == K, "linear_int8: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N, "linear_int8: fp32 scales [N]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()), "linear_int8: an fp32 bias");
  const float* sp = scale.data_ptr<float>();
  return bf16_blocks::run<float, kGroup>(x, N, K, (const int8_t*)packed.data_ptr(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                                         [sp](int m, int, const float* x, const int8_t* w, const float* bias, uint16_t* y, int64_t N,
                                              int64_t K, int64_t nb) { rows<int8_t>(m, x, w, sp, bias, y, N, K, nb); });
}

// 4-bit weights through this variant's row loop (q4_blocks.h).
#include "q4_blocks.h"
