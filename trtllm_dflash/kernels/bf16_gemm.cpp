// y = x W^T (+ bias) for bf16 x [M, K] and W [N, K] on CPUs with AVX-512 BF16, from W repacked once as
// [N/32][K/2][32][2] (each 128-byte line: 32 outputs x one pair of inputs, the layout VDPBF16PS reads).
//
// Why (figures in bf16_gemm.py): a decode step and a verify of a few tokens both just stream the weights, which this
// loop does at memory speed for 1-8 rows. Every output is one fp32 accumulator over the input pairs in order, rounded
// once to bf16, whatever M is and wherever the row sits: a row's result does not depend on the rows beside it
// (batch-invariant), which no library kernel here promises. The bias comes in fp32.
//
// Built with AMX (the `amx` variant: -mamx-tile -mamx-bf16), the same layout feeds AMX's tile multiply instead: a
// tile of 16 weight pairs x 16 outputs is 16 rows of 64 bytes, 128 bytes apart in the packed lines, so the weights
// are read as packed for VDPBF16PS, and up to 16 rows of x cost one pass over them at memory speed.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
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

using bf16_blocks::kBlock;  // outputs per block: two 16-lane accumulators
constexpr int kRows = 8;        // rows per pass (2 x 8 accumulators + operands fit the 32 registers)
// Each pass asks for the weights 1.5 KB ahead of the ones it multiplies. On a 2-core Xeon with AMX whose memory is slow
// (one core streams 8 GB/s), the hardware prefetcher alone left 1-8 rows 15-25 % slower on one thread; 4 KB ahead,
// every prefetch a page beyond its loads, left 2 rows (a chat verify) well behind 1 and 3 in the machine's slow spells,
// 1.5 KB did not (docs/performance.md#bf16-kernel-prefetch).
constexpr int64_t kPrefetchBytes = 1536;

// Blocks a pass multiplies for M rows: two accumulators per block and row, the rows' inputs and one block's weights
// in the 32 registers, at most 4. With one block a pass, a verify's few rows fell well behind one row on the 2-core
// Xeon held off AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: this variant, as CPUs with AVX-512 BF16 and no AMX run it);
// with several blocks a pass 2-4 rows cost about what one does, the same bits: more weight streams and more
// independent sums in flight, the rows' arithmetic hidden under the weights' transfer. (A Zen 4 ran one block a pass
// as fast for any of 1-8 rows: there it was not behind.) Figures: docs/performance.md#bf16-kernel-avx512-blocks.
constexpr int kMaxBlocks = 4;
constexpr int blocks_per_pass(int m) { return std::max(1, std::min(kMaxBlocks, (32 - m - 2) / (2 * m))); }

// Rows x[0..M) times blocks nb..nb+B-1 (block b's weights at w + b * stride).
template <int M, int B>
void block_rows(const uint16_t* x, const uint16_t* w, int64_t stride, const float* bias, uint16_t* y, int64_t N, int64_t K,
                int64_t nb) {
  __m512 acc[B][2][M];
  for (int b = 0; b < B; ++b)
    for (int m = 0; m < M; ++m) acc[b][0][m] = acc[b][1][m] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh xb[M];
    for (int m = 0; m < M; ++m) xb[m] = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + m * K + 2 * kp));
    for (int b = 0; b < B; ++b) {
      const uint16_t* line = w + b * stride + kp * 64;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(line + 32);
      _mm_prefetch((const char*)line + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch((const char*)line + kPrefetchBytes + 64, _MM_HINT_T0);
      for (int m = 0; m < M; ++m) {
        acc[b][0][m] = _mm512_dpbf16_ps(acc[b][0][m], xb[m], w0);
        acc[b][1][m] = _mm512_dpbf16_ps(acc[b][1][m], xb[m], w1);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t out = (nb + b) * kBlock;
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace amx {

constexpr int64_t kTileRows = 16;  // rows of x in a tile (more are taken 16 at a time, the last group padded)
constexpr int64_t kPairs = 16;     // weight pairs a tile step multiplies (32 inputs)

struct TileConfig {  // palette 1: per tile, its rows and bytes per row
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kBlocks = 3;  // blocks a pass (their sums in tmm2-tmm7)

// One block's weight tiles for 16 pairs (`lines`: the first pair's line) into tmm1 in turn, each multiplied into its sum.
#define AMX_BLOCK_STEP(lines, sum0, sum1)  \
  _tile_loadd(1, (lines), 128);            \
  _tile_dpbf16ps(sum0, 0, 1);              \
  _tile_loadd(1, (lines) + 64, 128);       \
  _tile_dpbf16ps(sum1, 0, 1);

// Rows x[0..R) (R: the configured tile rows) times blocks nb..nb+B-1 (block b's weights at w + b * stride); rows [0, M)
// are stored. tmm0: 32 inputs of each row; tmm1: a block's outputs 0-15 or 16-31 over 16 weight pairs, loaded in turn;
// tmm2 + 2b, tmm3 + 2b: block b's sums. Pairs past the last whole tile step (K not a multiple of 32) are added to the
// sums with VDPBF16PS. Only a block's first group of rows asks for its weights ahead: the others find them in cache.
// Three blocks a pass rather than one: SmolLM2's linears 12-19 % faster for 1-16 rows, the same bits
// (docs/performance.md#bf16-kernel-amx-blocks): as in the AVX-512 variant, more weight streams in flight.
template <int B>
void block(const uint16_t* x, const uint16_t* w, int64_t stride, const float* bias, uint16_t* y, int64_t M, int64_t N, int64_t K,
           int64_t nb, bool prefetch) {
  _tile_zero(2);
  _tile_zero(3);
  if constexpr (B > 1) {
    _tile_zero(4);
    _tile_zero(5);
  }
  if constexpr (B > 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  const int64_t whole = K / 2 / kPairs * kPairs;
  for (int64_t kp = 0; kp < whole; kp += kPairs) {
    if (prefetch)
      for (int b = 0; b < B; ++b) {
        const char* lines = (const char*)(w + b * stride + kp * 64) + kPrefetchBytes;
        for (int64_t i = 0; i < kPairs * 128; i += 64) _mm_prefetch(lines + i, _MM_HINT_T0);
      }
    _tile_loadd(0, x + 2 * kp, K * 2);
    AMX_BLOCK_STEP((const char*)(w + kp * 64), 2, 3)
    if constexpr (B > 1) { AMX_BLOCK_STEP((const char*)(w + stride + kp * 64), 4, 5) }
    if constexpr (B > 2) { AMX_BLOCK_STEP((const char*)(w + 2 * stride + kp * 64), 6, 7) }
  }
  alignas(64) float sums[2 * B][kTileRows][16];
  _tile_stored(2, sums[0], 64);
  _tile_stored(3, sums[1], 64);
  if constexpr (B > 1) {
    _tile_stored(4, sums[2], 64);
    _tile_stored(5, sums[3], 64);
  }
  if constexpr (B > 2) {
    _tile_stored(6, sums[4], 64);
    _tile_stored(7, sums[5], 64);
  }
  for (int b = 0; b < B; ++b) {
    const uint16_t* wb = w + b * stride;
    const int64_t out = (nb + b) * kBlock;
    for (int64_t m = 0; m < M; ++m) {
      __m512 a0 = _mm512_load_ps(sums[2 * b][m]), a1 = _mm512_load_ps(sums[2 * b + 1][m]);
      for (int64_t kp = whole; kp < K / 2; ++kp) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + m * K + 2 * kp));
        a0 = _mm512_dpbf16_ps(a0, xb, (__m512bh)_mm512_loadu_si512(wb + kp * 64));
        a1 = _mm512_dpbf16_ps(a1, xb, (__m512bh)_mm512_loadu_si512(wb + kp * 64 + 32));
      }
      if (bias) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(bias + out));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(bias + out + 16));
      }
      _mm256_storeu_si256((__m256i*)(y + m * N + out), (__m256i)_mm512_cvtneps_pbh(a0));
      _mm256_storeu_si256((__m256i*)(y + m * N + out + 16), (__m256i)_mm512_cvtneps_pbh(a1));
    }
  }
}
#undef AMX_BLOCK_STEP

// The process must have asked the kernel for AMX's state first (bf16_gemm.py: amx_permitted, arch_prctl).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const auto [N, K] = bf16_blocks::check(x, packed, bias);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), R = std::min(M, kTileRows);
  if (M > kTileRows && M % kTileRows) {  // whole tiles of rows: the last group's padding is multiplied, never stored
    auto padded = at::zeros({(M + kTileRows - 1) / kTileRows * kTileRows, K}, x2.options());
    padded.narrow(0, 0, M).copy_(x2);
    x2 = padded;
  }
  auto y = at::empty({M, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x2.data_ptr();
  const uint16_t* wp = (const uint16_t*)packed.data_ptr();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  uint16_t* yp = (uint16_t*)y.data_ptr();
  at::parallel_for(0, N / kBlock, 4, [&](int64_t b0, int64_t b1) {
    TileConfig config;  // per thread: a tile configuration is a thread's state
    for (int t : {0, 2, 3, 4, 5, 6, 7}) config.rows[t] = R, config.colsb[t] = 64;
    config.rows[1] = kPairs, config.colsb[1] = 64;
    _tile_loadconfig(&config);
    const int64_t stride = (K / 2) * 64;
    for (int64_t nb = b0; nb < b1; nb += kBlocks) {
      const int64_t nbs = std::min<int64_t>(kBlocks, b1 - nb);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t m = std::min(kTileRows, M - m0);
        const uint16_t* w = wp + nb * stride;
        if (nbs == 3) block<3>(xp + m0 * K, w, stride, bp, yp + m0 * N, m, N, K, nb, m0 == 0);
        else if (nbs == 2) block<2>(xp + m0 * K, w, stride, bp, yp + m0 * N, m, N, K, nb, m0 == 0);
        else block<1>(xp + m0 * K, w, stride, bp, yp + m0 * N, m, N, K, nb, m0 == 0);
      }
    }
    _tile_release();  // leaves no tile state for the kernel to save at a context switch
  });
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace amx
#endif

// `nbs` (at most blocks_per_pass(M)) blocks for m rows.
template <int M>
void blocks(int nbs, const uint16_t* x, const uint16_t* w, int64_t stride, const float* bias, uint16_t* y, int64_t N, int64_t K,
            int64_t nb) {
  constexpr int B = blocks_per_pass(M);
  if constexpr (B >= 4) if (nbs == 4) return block_rows<M, 4>(x, w, stride, bias, y, N, K, nb);
  if constexpr (B >= 3) if (nbs == 3) return block_rows<M, 3>(x, w, stride, bias, y, N, K, nb);
  if constexpr (B >= 2) if (nbs == 2) return block_rows<M, 2>(x, w, stride, bias, y, N, K, nb);
  return block_rows<M, 1>(x, w, stride, bias, y, N, K, nb);
}

// m rows of blocks nb..nb+nbs-1 (nbs at most blocks_per_pass(m): the shared loop's `per_pass` for its first group).
void rows(int m, int nbs, const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t N, int64_t K, int64_t nb) {
  const int64_t stride = (K / 2) * 64;
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

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx::linear(x, packed, bias);
#else
  const auto [N, K] = bf16_blocks::check(x, packed, bias);  // blocks_per_pass of a group's rows at a time
  const int group = (int)std::clamp<int64_t>(x.numel() / K, 1, kRows);
  return bf16_blocks::run<uint16_t, kRows>(x, N, K, (const uint16_t*)packed.data_ptr(),
                                           bias.has_value() ? bias->data_ptr<float>() : nullptr, rows, blocks_per_pass(group));
#endif
}

// 4-bit weights through this variant's row loop (q4_blocks.h).
#include "q4_blocks.h"
