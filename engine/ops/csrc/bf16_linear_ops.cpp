// The bfloat16 linear op's entry point (kernels and layout in bf16_linear_kernels.cpp):
// tensor checks, the split of output tiles over torch's threads (parallel.h), and the
// instruction set (kernels.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "kernels.h"
#include "parallel.h"
#include "row_argmax.h"

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
at::Tensor argmax_of(const at::Tensor& xc, const at::Tensor& weight, int64_t N, int64_t K,
                     int64_t n_valid, const Kernels& kernels) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  const int64_t M = xc.size(0);
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  if (M == 0) return out;
  const auto kernel = kernels.bf16_tiles;
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
  RowArgmax best(tasks, M);
  parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<c10::BFloat16> y(M * run * kTile);
    for (int64_t task = first; task < last; ++task) {
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
            best.offer(task, r, n0, cols, [&](int64_t c) { return order_key(row[c]); });
          }
        }
      }
    }
  });
  best.write(out.data_ptr<int64_t>());
  return out;
}

at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                              int64_t n_valid, const std::optional<std::string>& isa) {
  const int64_t K = check_tiled(x, weight, N);
  TORCH_CHECK(n_valid > 0 && n_valid <= N, "n_valid=", n_valid, " must be in 1..", N);
  return argmax_of(x.contiguous(), weight, N, K, n_valid, kernels_for(isa));
}

// ---------------------------------------------------------------------------------------
// The screened argmax: bf16_linear_argmax's tokens from half its reading, for steps of a
// few rows (engine/models/head_screen.py builds the screen and says when it runs).
//
// Each weight row w (K bfloat16) has an int8 copy q with one float32 scale s, and two
// bounds E >= |e| + slack and F >= |s q|, e = w - s q, |.| the Euclidean norm (the slack
// covers the kernel's float32 sums, below). Each row h of x is rounded to int16 with one
// scale d: h = d p + f. Then the row's exact logit t = h . w is
//
//   t = a + h . e + f . (s q),    a = d s (p . q),    |t - a| <= |h| E + |f| F = B,
//
// with p . q an exact integer sum (kernels.h, int8_row_dots: half the bytes of w). The
// kernel's logit k = bf16_linear's float32 sum before rounding to bfloat16 is within the
// slack of t, so lo = a - B <= k <= hi = a + B for every row. The row that bf16_linear's
// argmax picks has the largest bfloat16 logit, which no row whose k lies more than a
// bfloat16 spacing below max(lo) can reach: so only the rows with hi >= max(lo) - margin
// can be picked, and their tiles, computed by the same kernel as bf16_linear_argmax with
// the same rows of x, give the same numbers and the same choice (the first on ties). On
// the default model's hidden states that is a few rows of 49152 (benchmarks/head_screen.py
// counts them). Where the screen cannot decide cheaply (a row of x not finite or zero,
// more than kMaxScreenTiles candidate tiles), the whole head runs instead.

// Candidate tiles past which the whole head runs: each is 16 rows of K bfloat16.
constexpr int64_t kMaxScreenTiles = 64;
// Weight rows per task of the screen's pass.
constexpr int64_t kScreenRowsPerChunk = 256;

// Relative slack for the screen's float32 arithmetic, and the margin below max(lo): a row
// whose bfloat16 logit reaches bf16(k) >= bf16(lo) has k >= lo less half a bfloat16 spacing
// each side of bf16(lo), which is at most 2^-7 of |lo| (2^-6 across a power of two).
constexpr float kScreenSlack = 0x1p-18f;
constexpr double kScreenMargin = 0x1p-6;
constexpr float kScreenFloor = 1e-30f;

double screen_threshold(double best_lo) {
  return best_lo - (kScreenMargin * std::abs(best_lo) + kScreenFloor);
}

// Checks the screen (N, Kp) int8 and bounds (3, N) float32 for x (M, K) bfloat16.
void check_screen(const at::Tensor& x, int64_t n_valid, const at::Tensor& screen,
                  const at::Tensor& bounds) {
  const int64_t N = screen.size(0);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "x must be a bfloat16 (M, K) CPU tensor");
  TORCH_CHECK(n_valid > 0 && n_valid <= N, "n_valid=", n_valid, " must be in 1..", N);
  TORCH_CHECK(screen.device().is_cpu() && screen.scalar_type() == at::kChar &&
                  screen.dim() == 2 && screen.is_contiguous() && screen.size(0) == N &&
                  screen.size(1) >= x.size(1) && screen.size(1) % 32 == 0,
              "screen must be a contiguous (N, K padded to 32) int8 CPU tensor");
  TORCH_CHECK(bounds.device().is_cpu() && bounds.scalar_type() == at::kFloat &&
                  bounds.dim() == 2 && bounds.is_contiguous() && bounds.size(0) == 3 &&
                  bounds.size(1) == N,
              "bounds must be a contiguous (3, N) float32 CPU tensor");
}

// The tiles of the rows that the screen keeps for any row of xc (M, K), ascending; none
// where it cannot decide (the whole head must run).
std::optional<std::vector<int64_t>> screen_tiles(const at::Tensor& xc, int64_t n_valid,
                                                 const at::Tensor& screen,
                                                 const at::Tensor& bounds,
                                                 const Kernels& kernels) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  const int64_t M = xc.size(0), K = xc.size(1), N = screen.size(0), Kp = screen.size(1);
  // The rows of x as int16: |p| <= P keeps every row's sum within int32.
  const int64_t P = std::min<int64_t>(32767, INT32_MAX / (128 * Kp));
  std::vector<int16_t> xq(M * Kp, 0);
  std::vector<float> scale(M), h_norm(M), f_norm(M);
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    double amax = 0.0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(double(xp[m * K + k])));
    if (!std::isfinite(amax) || amax == 0.0) return std::nullopt;
    const float d = static_cast<float>(amax / double(P));
    double hh = 0.0, ff = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double h = double(xp[m * K + k]);
      const double p = std::clamp(std::nearbyint(h / d), -double(P), double(P));
      xq[m * Kp + k] = static_cast<int16_t>(p);
      hh += h * h;
      ff += (h - double(d) * p) * (h - double(d) * p);
    }
    scale[m] = d;
    h_norm[m] = static_cast<float>(std::sqrt(hh) * (1 + kScreenSlack));
    f_norm[m] = static_cast<float>(std::sqrt(ff) * (1 + kScreenSlack));
  }
  // One pass over the screen: each row's hi and each task's largest lo; then the rows whose
  // hi clears the threshold of the largest lo of all. (A threshold of each task's own lo
  // kept too many rows where the head's other half holds thousands of rows alike, as
  // untrained tokens are, and the largest logit lies in this half.) The bounds' arithmetic
  // is float32, its rounding (a few float32 ulps) covered by kScreenSlack of every term.
  const int8_t* qp = screen.data_ptr<int8_t>();
  const float* s_of = bounds.data_ptr<float>();
  const float *e_of = s_of + N, *f_of = s_of + 2 * N;
  const int64_t chunks = (n_valid + kScreenRowsPerChunk - 1) / kScreenRowsPerChunk;
  const int64_t tasks = std::clamp<int64_t>(chunks, 1, at::get_num_threads());
  // Kept between calls: a fresh buffer of this size is fresh pages from the kernel each time.
  // (A thread_local names each thread's own: the tasks take its data pointer.)
  thread_local std::vector<float> hi_buffer;
  hi_buffer.resize(std::max<size_t>(hi_buffer.size(), M * n_valid));
  float* const hi_of = hi_buffer.data();
  std::vector<float> best_lo(tasks * M, -std::numeric_limits<float>::infinity());
  parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<int32_t> dots(kScreenRowsPerChunk * M);
    for (int64_t task = first; task < last; ++task) {
      const int64_t c0 = task * chunks / tasks, c1 = (task + 1) * chunks / tasks;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t r0 = c * kScreenRowsPerChunk;
        const int64_t rows = std::min(kScreenRowsPerChunk, n_valid - r0);
        kernels.int8_row_dots(qp + r0 * Kp, Kp, xq.data(), M, rows, dots.data());
        const float *s = s_of + r0, *e = e_of + r0, *f = f_of + r0;
        for (int64_t m = 0; m < M; ++m) {
          const int32_t* dm = dots.data() + m * rows;
          float* hi = hi_of + m * n_valid + r0;
          const float d = scale[m], hn = h_norm[m], fn = f_norm[m];
          float lo_max = best_lo[task * M + m];
#pragma omp simd reduction(max : lo_max)
          for (int64_t i = 0; i < rows; ++i) {
            const float a = static_cast<float>(dm[i]) * (d * s[i]);
            const float bound = hn * e[i] + fn * f[i];
            const float slack = kScreenSlack * (std::abs(a) + bound) + kScreenFloor;
            lo_max = std::max(lo_max, a - bound - slack);
            hi[i] = a + bound + slack;
          }
          best_lo[task * M + m] = lo_max;
        }
      }
    }
  });
  std::vector<int64_t> tiles;
  for (int64_t m = 0; m < M; ++m) {
    double lo = -std::numeric_limits<double>::infinity();
    for (int64_t task = 0; task < tasks; ++task) lo = std::max(lo, double(best_lo[task * M + m]));
    // A NaN anywhere (lo is then -inf or NaN): the whole head decides.
    if (!std::isfinite(lo)) return std::nullopt;
    const double threshold = screen_threshold(lo);
    const float* hi = hi_of + m * n_valid;
    for (int64_t r = 0; r < n_valid; ++r) {
      if (!(double(hi[r]) < threshold)) {
        if (tiles.empty() || tiles.back() != r / kTile) tiles.push_back(r / kTile);
        if (static_cast<int64_t>(tiles.size()) > kMaxScreenTiles * M) return std::nullopt;
      }
    }
  }
  std::sort(tiles.begin(), tiles.end());
  tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
  if (static_cast<int64_t>(tiles.size()) > kMaxScreenTiles || tiles.empty()) return std::nullopt;
  return tiles;
}

at::Tensor bf16_linear_argmax_screened(const at::Tensor& x, const at::Tensor& weight,
                                       int64_t N, int64_t n_valid, const at::Tensor& screen,
                                       const at::Tensor& bounds,
                                       const std::optional<std::string>& isa) {
  constexpr int64_t kTile = Bf16Weight::kTile;
  const int64_t K = check_tiled(x, weight, N);
  check_screen(x, n_valid, screen, bounds);
  TORCH_CHECK(screen.size(0) == N, "the screen has ", screen.size(0), " rows, the head ", N);
  const at::Tensor xc = x.contiguous();
  const Kernels& kernels = kernels_for(isa);
  const int64_t M = xc.size(0);
  if (M == 0) return at::empty({0}, xc.options().dtype(at::kLong));
  const auto tiles = screen_tiles(xc, n_valid, screen, bounds, kernels);
  if (!tiles) return argmax_of(xc, weight, N, K, n_valid, kernels);
  // The candidates' tiles, each as bf16_linear_argmax computes it (the same kernel, rows and
  // tile), in order: the first of equal logits wins.
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  std::vector<c10::BFloat16> y(M * kTile);
  std::vector<int32_t> key(M, INT32_MIN);
  std::vector<int64_t> index(M, -1);
  for (const int64_t t : *tiles) {
    const int64_t n0 = t * kTile, width = std::min(N, n0 + kTile) - n0;
    TileClaims one(0, 1, 1, 1);
    kernels.bf16_tiles(Bf16Weight{wp + t * K * kTile, width, K}, xp, M, Bf16Out{y.data()}, one);
    const int64_t cols = std::min(width, n_valid - n0);
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(y.data()) + m * width;
      for (int64_t c = 0; c < cols; ++c) {
        const int32_t k = order_key(row[c]);
        if (k > key[m]) key[m] = k, index[m] = n0 + c;
      }
    }
  }
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  std::copy(index.begin(), index.end(), out.data_ptr<int64_t>());
  return out;
}

// The screen's candidate tiles for x (tests, benchmarks): ascending, or none where the whole
// head would run.
at::Tensor bf16_linear_screen_tiles(const at::Tensor& x, int64_t n_valid,
                                    const at::Tensor& screen, const at::Tensor& bounds,
                                    const std::optional<std::string>& isa) {
  check_screen(x, n_valid, screen, bounds);
  const at::Tensor xc = x.contiguous();
  const auto tiles = xc.size(0) == 0 ? std::nullopt
                                     : screen_tiles(xc, n_valid, screen, bounds, kernels_for(isa));
  const int64_t count = tiles ? static_cast<int64_t>(tiles->size()) : 0;
  at::Tensor out = at::empty({count}, xc.options().dtype(at::kLong));
  if (count) std::copy(tiles->begin(), tiles->end(), out.data_ptr<int64_t>());
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
  m.def(
      "bf16_linear_argmax_screened(Tensor x, Tensor weight, int n, int n_valid, Tensor screen, "
      "Tensor bounds, str? isa=None) -> Tensor");
  m.def(
      "bf16_linear_screen_tiles(Tensor x, int n_valid, Tensor screen, Tensor bounds, "
      "str? isa=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("bf16_linear", &pagedserve::bf16_linear);
  m.impl("bf16_linear_argmax", &pagedserve::bf16_linear_argmax);
  m.impl("bf16_linear_argmax_screened", &pagedserve::bf16_linear_argmax_screened);
  m.impl("bf16_linear_screen_tiles", &pagedserve::bf16_linear_screen_tiles);
}
