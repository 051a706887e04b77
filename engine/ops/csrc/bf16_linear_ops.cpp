// The bfloat16 linear op's entry point (kernels and layout in bf16_linear_kernels.cpp):
// tensor checks, the split of output tiles over torch's threads (parallel.h), and the
// instruction set (kernels.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "kernels.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// Weights per parallel task: enough that a fork-join pays for itself.
constexpr int64_t kMinWeightsPerTask = 1 << 16;

// Checks x (M, K) and a weight tiled as (tiles, K/2, 16, 2) bfloat16 for N outputs;
// returns K.
int64_t check_tiled(const at::Tensor& x, const at::Tensor& weight, int64_t N) {
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
  return K;
}

// Outputs of at least this many bytes ask for huge pages (below): glibc's largest threshold
// for mapping an allocation anew (M_MMAP_THRESHOLD's dynamic maximum on 64-bit).
constexpr int64_t kHugeOutputBytes = 32 << 20;
// float32 outputs of at least this many bytes are streamed (below).
constexpr int64_t kStreamBytes = 8 << 20;
constexpr uintptr_t kHugePage = 2 << 20;

// An output that large is fresh memory from the kernel each time (glibc maps it anew, and
// unmaps it when freed), and its first write faults every 4 KB page in: an LM head over a
// 512-row prefill writes 50 MB, whose 12,000 faults took a third of its time on a 2-core
// VM. Where transparent huge pages are enabled for madvise'd memory (a common default), the
// 2 MB pages inside the buffer fault in 512 times fewer. Smaller outputs come back from
// malloc's heap already faulted in after the first step, and are left alone: with THP's
// defrag set to madvise, a huge page fault may stop for compaction, which a decode step's
// logits (64 rows: 12.6 MB in float32) should not wait on. Harmless where THP is off:
// madvise then fails, and the pages stay small.
void prefer_huge_pages(const at::Tensor& t) {
  const int64_t bytes = t.numel() * t.element_size();
  if (bytes < kHugeOutputBytes) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t last = (begin + bytes) & ~(kHugePage - 1);
  if (last > first) {
    // The result is only advice: an error leaves the buffer as it was.
    (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
}

// x (M, K) @ W^T -> (M, N) bfloat16, W tiled as (tiles, K/2, 16, 2) bfloat16; or float32
// (out_dtype) holding the same bfloat16-rounded numbers, as .float() of that would.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                       const std::optional<std::string>& isa,
                       std::optional<at::ScalarType> out_dtype) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  const int64_t tiles = weight.size(0), K = check_tiled(x, weight, N);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "out_dtype must be bfloat16 or float32, not ", dtype);
  at::Tensor y = at::empty({M, N}, xc.options().dtype(dtype));
  if (M == 0) return y;
  prefer_huge_pages(y);
  const Bf16Weight w{weight.data_ptr<c10::BFloat16>(), N, K};
  const auto kernel = kernels_for(isa).bf16_tiles;
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  // float32 logits of more than kStreamBytes (64 rows of a 32k vocabulary) leave the
  // caches to the weights and go straight to memory, where the sampler reads them from
  // anyway: they need not be read for ownership first. The default model's head (49152 x
  // 576), one process switching: 64 rows 747 -> 901 GFLOP/s, 128 750 -> 931, 512 691 ->
  // 840; a bfloat16 output (the next layer's input, read at once) stays in the caches.
  const bool stream = dtype == at::kFloat && y.numel() * 4 >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(y.data_ptr()) % 64 == 0 && N % 16 == 0;
  const Bf16Out yp{y.data_ptr(), dtype == at::kFloat, stream};
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (kTile * K));
  parallel_tiles(tiles, grain, 2 * M * K * kTile,
                 [&](TileClaims& claims) { kernel(w, xp, M, yp, claims); });
  return y;
}

// A bfloat16 number's bits as an int16 that orders as the number does: -0 and +0 equal,
// and c10's NaN (0x7FC0, the only NaN bf16_tiles stores) above +inf, as argmax counts it.
inline int32_t order_key(uint16_t bits) {
  const int32_t s = static_cast<int16_t>(bits);
  const int32_t negative = s >> 15;  // -1 or 0
  return (s ^ (negative & 0x7FFF)) - negative;
}

// Bytes of outputs a thread computes at a time into its own buffer, which stays in its L2
// while it looks for each row's largest.
constexpr int64_t kArgmaxRunBytes = 128 << 10;

// Each row's argmax over the first n_valid outputs of x W^T (M,) int64: the same index as
// argmax over bf16_linear's bfloat16 result (the first on ties, NaN the largest), without
// the (M, N) result: greedy sampling from an LM head. Each thread computes runs of tiles
// into a small buffer of its own and keeps each row's best so far; the threads' bests
// meet at the end (ties to the lower index).
at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                              int64_t n_valid, const std::optional<std::string>& isa) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  const int64_t K = check_tiled(x, weight, N);
  TORCH_CHECK(n_valid > 0 && n_valid <= N, "n_valid=", n_valid, " must be in 1..", N);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0);
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  if (M == 0) return out;
  const auto kernel = kernels_for(isa).bf16_tiles;
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  const int64_t valid_tiles = (n_valid + kTile - 1) / kTile;
  const int64_t run = std::max<int64_t>(1, kArgmaxRunBytes / (M * kTile * 2));
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (kTile * K));
  const int64_t tasks =
      std::clamp<int64_t>((valid_tiles + grain - 1) / grain, 1, at::get_num_threads());
  // Claims of at least `grain` tiles, the longer first (TileClaims), each computed `run`
  // tiles at a time. (Claims of at least `run` tiles left one thread the whole head of a
  // step of 1 to 4 rows, whose runs are longer: 1.6 ms for SmolLM2's 49152 x 576 head at
  // one row, where bf16_linear took 1.0.)
  TileClaims claims(0, valid_tiles, grain, tasks);
  std::vector<int32_t> best_key(tasks * M, INT32_MIN);
  std::vector<int64_t> best_index(tasks * M, -1);
  parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<c10::BFloat16> y(M * run * kTile);
    for (int64_t task = first; task < last; ++task) {
      int32_t* keys = best_key.data() + task * M;
      int64_t* index = best_index.data() + task * M;
      for (int64_t begin, end; claims.claim(begin, end);) {
        for (int64_t t0 = begin; t0 < end; t0 += run) {
          const int64_t count = std::min(run, end - t0);
          const int64_t n0 = t0 * kTile, width = std::min(N, (t0 + count) * kTile) - n0;
          // Tiles t0.. as a weight of their own, whose outputs are `width` wide.
          const Bf16Weight part{wp + t0 * K * kTile, width, K};
          TileClaims all(0, count, count, 1);
          kernel(part, xp, M, Bf16Out{y.data()}, all);
          const int64_t cols = std::min(width, n_valid - n0);
          for (int64_t r = 0; r < M; ++r) {
            const uint16_t* row = reinterpret_cast<const uint16_t*>(y.data()) + r * width;
            int32_t top = INT32_MIN;
            for (int64_t c = 0; c < cols; ++c) top = std::max(top, order_key(row[c]));
            // A thread's runs go up the columns: only a larger value wins.
            if (top <= keys[r]) continue;
            int64_t c = 0;
            while (order_key(row[c]) != top) ++c;
            keys[r] = top;
            index[r] = n0 + c;
          }
        }
      }
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    int32_t key = INT32_MIN;
    int64_t index = -1;
    for (int64_t task = 0; task < tasks; ++task) {
      const int32_t k = best_key[task * M + r];
      const int64_t i = best_index[task * M + r];
      if (i >= 0 && (k > key || (k == key && i < index))) key = k, index = i;
    }
    op[r] = index;
  }
  return out;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "bf16_linear(Tensor x, Tensor weight, int n, str? isa=None, ScalarType? out_dtype=None) "
      "-> Tensor");
  m.def(
      "bf16_linear_argmax(Tensor x, Tensor weight, int n, int n_valid, str? isa=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bf16_linear", &pagedserve::bf16_linear);
  m.impl("bf16_linear_argmax", &pagedserve::bf16_linear_argmax);
}
