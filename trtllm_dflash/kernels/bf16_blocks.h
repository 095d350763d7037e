// What both bf16 matrix kernel variants share: the packed weight layout [N/32][K/2][32][2] and the loop that runs a
// variant's row kernel over every block of 32 outputs (compiled with each variant's instruction set).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include <type_traits>
#include <utility>

namespace bf16_blocks {

constexpr int64_t kBlock = 32;  // outputs per block of the packed layout

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kBlock == 0 && K % 2 == 0, "pack: out_features must be a multiple of 32 and in_features even");
  return weight.contiguous().view({N / kBlock, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The checks every variant's linear makes; returns the weight's {N, K}.
inline std::pair<int64_t, int64_t> check(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear: bf16 tensors");
  const int64_t N = packed.size(0) * kBlock, K = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == K, "linear: input has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous()), "linear: an fp32 bias");
  return {N, K};
}

// The loop every variant runs over the blocks of 32 outputs: `rows(m, nbs, x, w, bias, y, N, K, nb)` computes up to
// kRows rows of blocks nb..nb+nbs-1 from their weights `w` (block b's K/2 lines of 64 elements at w + b * K/2 * 64:
// bf16 pairs, or an int8 layout of the same shape), nbs at most `per_pass`; the inputs reach it as XT (uint16_t: bf16
// as they are; float: widened once, exactly). Each block's weights are read from memory once and reused from cache
// for every further group of rows.
template <typename XT, int kRows, typename WT, typename Rows>
at::Tensor run(const at::Tensor& x, int64_t N, int64_t K, const WT* wp, const float* bp, Rows rows, int per_pass = 1) {
  const auto x2 = std::is_same<XT, float>::value ? x.reshape({-1, K}).to(at::kFloat).contiguous() : x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x.options());
  const XT* xp = (const XT*)x2.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  at::parallel_for(0, N / kBlock, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb += per_pass) {
      const int nbs = (int)std::min<int64_t>(per_pass, b1 - nb);
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        rows((int)std::min<int64_t>(kRows, M - m0), nbs, xp + m0 * K, wp + nb * (K / 2) * 64, bp, yp + m0 * N, N, K, nb);
    }
  });
  return y.view(sizes);
}

// y = x W^T (+ bias) for W packed by `pack`.
template <typename XT, int kRows, typename Rows>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, Rows rows) {
  const auto [N, K] = check(x, packed, bias);
  return run<XT, kRows>(x, N, K, (const uint16_t*)packed.data_ptr(), bias.has_value() ? bias->data_ptr<float>() : nullptr, rows);
}

}  // namespace bf16_blocks
