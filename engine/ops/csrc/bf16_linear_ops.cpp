// The bfloat16 linear op's entry point (kernels and layout in bf16_linear_kernels.cpp):
// tensor checks, the split of output tiles over torch's threads (parallel.h), and the
// instruction set (kernels.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// Weights per parallel task: enough that a fork-join pays for itself.
constexpr int64_t kMinWeightsPerTask = 1 << 16;

// x (M, K) @ W^T -> (M, N) bfloat16, W tiled as (tiles, K/2, 16, 2) bfloat16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                       const std::optional<std::string>& isa) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 &&
                  weight.dim() == 4 && weight.is_contiguous() && weight.size(2) == kTile &&
                  weight.size(3) == 2,
              "weight must be a tiled (tiles, K/2, 16, 2) contiguous bfloat16 CPU tensor");
  const int64_t tiles = weight.size(0), K = weight.size(1) * 2;
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "N=", N, " does not fit ", tiles,
              " tiles");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.size(1) == K,
              "x must be a bfloat16 (M, ", K, ") CPU tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
  const Bf16Weight w{weight.data_ptr<c10::BFloat16>(), N, K};
  const auto kernel = kernels_for(isa).bf16_tiles;
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (kTile * K));
  parallel_tiles(tiles, grain, 2 * M * K * kTile,
                 [&](TileClaims& claims) { kernel(w, xp, M, yp, claims); });
  return y;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, int n, str? isa=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bf16_linear", &pagedserve::bf16_linear);
}
