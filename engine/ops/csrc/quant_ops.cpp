// The quantized linear ops' entry points (kernels and layout in quant_kernels.cpp): tensor
// checks, the input rows in float32 with their group sums, the split of output tiles over
// torch's threads, and the instruction set (kernels.h). Also the dequantization of (rows
// of) a tiled weight, for embedding lookups and for steps too large for the kernel.

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "row_argmax.h"

namespace pagedserve {
namespace {

// Rows of x per pass over the weights: each unpacked weight vector serves this many.
constexpr int64_t kRowTile = 8;
// Weights per parallel task: enough that a fork-join pays for itself.
constexpr int64_t kMinQuantWeightsPerTask = 1 << 16;

QuantWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                         int64_t N) {
  constexpr int64_t kTile = QuantWeight::kTile, kBlock = QuantWeight::kBlock;
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights are 4 or 8 bits, not ", bits);
  TORCH_CHECK(group > 0 && group % kBlock == 0, "group_size must be a multiple of 32, got ",
              group);
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 4 && qweight.is_contiguous() &&
                  qweight.size(3) == kTile,
              "qweight must be a tiled (tiles, K/32, k, 16) contiguous CPU tensor");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "4-bit weights are uint8 nibble pairs, 8-bit weights int8");
  TORCH_CHECK(qweight.size(2) == (bits == 4 ? kBlock / 2 : kBlock), "wrong block shape");
  const int64_t tiles = qweight.size(0), K = qweight.size(1) * kBlock;
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "N=", N, " does not fit ", tiles,
              " tiles");
  TORCH_CHECK(K % group == 0, "K=", K, " is not a multiple of group_size=", group);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == tiles * (K / group) * kTile,
              "scales must be contiguous float16 (tiles, K / group_size, 16)");
  const c10::Half* m = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->numel() == scales.numel(),
                "4-bit weights need float16 mins shaped like scales");
    m = mins->data_ptr<c10::Half>();
  }
  return QuantWeight{static_cast<const uint8_t*>(qweight.data_ptr()),
                     scales.data_ptr<c10::Half>(), m, N, K, group, static_cast<int>(bits)};
}

// x's rows as the tile kernels read them: float32 with each group's sum, and (on AVX2, for
// bfloat16 x) int16 with a scale per block. Made here rather than with torch ops: a decode
// step prepares rows for every linear layer, and each extra op costs dispatch time. The
// buffers are the calling thread's, kept between calls (the tasks only read them, through
// the pointers this holds: a thread_local named in a task would be the running thread's
// own, empty, copy); xb points into xc, which must outlive them.
struct PreparedRows {
  const float* x32;
  const float* xsum;
  const int16_t* xq;
  const float* xq_scale;
  const c10::BFloat16* xb;
  int64_t K, groups;

  // Rows r0..r0 + count.
  QuantRows rows(int64_t r0, int64_t count) const {
    QuantRows rows{x32 + r0 * K, xb != nullptr ? xb + r0 * K : nullptr, xsum + r0 * groups,
                   count};
    if (xq != nullptr) {
      rows.xq = xq + r0 * K;
      rows.xq_scale = xq_scale + r0 * (K / QuantWeight::kBlock);
    }
    return rows;
  }
};

PreparedRows prepare_rows(const at::Tensor& xc, const QuantWeight& w, const Kernels& kernels) {
  const int64_t M = xc.size(0), K = w.K, group = w.group, groups = w.groups();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  thread_local std::vector<float> x32, xsum, xq_scale;
  thread_local std::vector<int16_t> xq;
  x32.resize(M * K);
  xsum.resize(M * groups);
  // Pointers taken once: data_ptr<T>() checks the dtype on every call, which cost more than
  // the conversion itself.
  const c10::BFloat16* xb = bf16 ? xc.data_ptr<c10::BFloat16>() : nullptr;
  if (bf16) {
    for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xb[i]);
  } else {
    std::copy_n(xc.data_ptr<float>(), M * K, x32.data());
  }
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = x32.data() + r * K + g * group;
      float sum = 0.f;
      for (int64_t k = 0; k < group; ++k) sum += v[k];
      xsum[r * groups + g] = sum;
    }
  }
  PreparedRows prepared{x32.data(), xsum.data(), nullptr, nullptr, xb, K, groups};
  // Only the AVX2 set reads the int16 rows (the AVX-512 sets have other paths).
  if (bf16 && std::strcmp(kernels.isa, "avx2") == 0) {
    xq.resize(M * K);
    xq_scale.resize(M * (K / QuantWeight::kBlock));
    kernels.quant_rows_int16(x32.data(), M, K, xq.data(), xq_scale.data());
    prepared.xq = xq.data();
    prepared.xq_scale = xq_scale.data();
  }
  return prepared;
}

void check_rows(const at::Tensor& x, const QuantWeight& w) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == w.K, "x must be (M, ", w.K,
              ") on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
}

// x (M, K) @ W^T -> (M, N) in x's dtype (float32 or bfloat16); or, for bfloat16 x and
// out_dtype float32, float32 holding the bfloat16 results (as .float() of them would be).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                        int64_t N, const std::optional<std::string>& isa,
                        std::optional<at::ScalarType> out_dtype) {
  const QuantWeight w = check_weight(qweight, scales, mins, bits, group, N);
  check_rows(x, w);
  const int64_t M = x.size(0), K = w.K;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(dtype == x.scalar_type() || (bf16 && dtype == at::kFloat),
              "out_dtype must be x's dtype, or float32 for bfloat16 x; not ", dtype);
  const bool widen = dtype != x.scalar_type();
  const Kernels& kernels = kernels_for(isa);
  const at::Tensor xc = x.contiguous();  // prepared's bfloat16 rows point into it
  const PreparedRows prepared = prepare_rows(xc, w, kernels);
  at::Tensor out = at::empty({M, N}, x.options().dtype(dtype));
  const auto tiles = kernels.quant_tiles;
  const int64_t grain = std::max<int64_t>(1, kMinQuantWeightsPerTask / (QuantWeight::kTile * K));
  char* outp = static_cast<char*>(out.data_ptr());
  parallel_tiles(w.tiles(), grain, 2 * M * K * QuantWeight::kTile, [&](TileClaims& claims) {
    for (int64_t begin, end; claims.claim(begin, end);) {
      for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
        const QuantRows rows = prepared.rows(r0, std::min(kRowTile, M - r0));
        char* base = outp + r0 * N * out.element_size();
        tiles(w, rows, QuantOut{base, bf16 && !widen, widen}, begin, end);
      }
    }
  });
  return out;
}

// A float32 number's bits as an int32 that orders as the number does, as numpy's argmax
// (argmax_rows in engine/worker/sampler.py) compares: -0 and +0 equal, NaN above +inf.
inline int32_t order_key(float v) {
  if (v != v) return INT32_MAX;
  if (v == 0.f) return 0;
  int32_t s;
  std::memcpy(&s, &v, sizeof(s));
  return s ^ ((s >> 31) & 0x7FFFFFFF);
}

// Bytes of outputs a thread computes at a time into its own buffer, which stays in its L2
// while it looks for each row's largest.
constexpr int64_t kQuantArgmaxRunBytes = 64 << 10;

// Each row's argmax over the first n_valid outputs of quant_linear(x, W) as an LM head's
// logits are (float32; for bfloat16 x, the bfloat16 results as float32), the first on ties:
// greedy tokens from a quantized head without the (M, N) logits. Each thread computes runs
// of tiles into a small buffer of its own, with the same kernel and rows as quant_linear
// (a tile's outputs depend only on its own weights), and keeps each row's best so far; the
// threads' bests meet at the end, ties to the lower index.
at::Tensor quant_linear_argmax(const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                               int64_t bits, int64_t group, int64_t N, int64_t n_valid,
                               const std::optional<std::string>& isa) {
  constexpr int64_t kTile = QuantWeight::kTile;
  const QuantWeight w = check_weight(qweight, scales, mins, bits, group, N);
  check_rows(x, w);
  TORCH_CHECK(n_valid > 0 && n_valid <= N, "n_valid=", n_valid, " must be in 1..", N);
  const int64_t M = x.size(0), K = w.K, groups = w.groups();
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return out;
  const bool rounded = x.scalar_type() == at::kBFloat16;
  const Kernels& kernels = kernels_for(isa);
  const at::Tensor xc = x.contiguous();
  const PreparedRows prepared = prepare_rows(xc, w, kernels);
  const auto tiles = kernels.quant_tiles;
  const int64_t valid_tiles = (n_valid + kTile - 1) / kTile;
  const int64_t row_tile = std::min(kRowTile, M);
  const int64_t run = std::max<int64_t>(1, kQuantArgmaxRunBytes / (row_tile * kTile * 4));
  const int64_t grain = std::max<int64_t>(1, kMinQuantWeightsPerTask / (kTile * K));
  const int64_t tasks =
      std::clamp<int64_t>((valid_tiles + grain - 1) / grain, 1, at::get_num_threads());
  TileClaims claims(0, valid_tiles, grain, tasks);
  RowArgmax best(tasks, M);
  parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> y(row_tile * run * kTile);
    for (int64_t task = first; task < last; ++task) {
      for (int64_t begin, end; claims.claim(begin, end);) {
        for (int64_t t0 = begin; t0 < end; t0 += run) {
          const int64_t count = std::min(run, end - t0);
          const int64_t n0 = t0 * kTile, width = std::min(N, (t0 + count) * kTile) - n0;
          const int64_t cols = std::min(width, n_valid - n0);
          // Tiles t0.. as a weight of their own, whose outputs are `width` wide.
          QuantWeight part = w;
          part.q = w.block(t0, 0);
          part.d = w.d + t0 * groups * kTile;
          part.m = w.m != nullptr ? w.m + t0 * groups * kTile : nullptr;
          part.N = width;
          for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
            const int64_t rows = std::min(kRowTile, M - r0);
            tiles(part, prepared.rows(r0, rows), QuantOut{y.data(), false, rounded}, 0, count);
            for (int64_t r = 0; r < rows; ++r) {
              const float* row = y.data() + r * width;
              best.offer(task, r0 + r, n0, cols, [&](int64_t c) { return order_key(row[c]); });
            }
          }
        }
      }
    }
  });
  best.write(out.data_ptr<int64_t>());
  return out;
}

// Dequantizes rows (all N when `rows` is absent) into `dtype`: (R, K).
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                            int64_t N, const std::optional<at::Tensor>& rows,
                            at::ScalarType dtype) {
  const QuantWeight w = check_weight(qweight, scales, mins, bits, group, N);
  const at::Tensor index = rows.has_value() ? rows->to(at::kLong).contiguous()
                                            : at::arange(N, qweight.options().dtype(at::kLong));
  TORCH_CHECK(index.dim() == 1, "rows must be 1-D");
  const int64_t R = index.numel();
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < N, "row ", ids[i], " is out of range [0, ", N, ")");
  }
  at::Tensor out32 = at::empty({R, w.K}, qweight.options().dtype(at::kFloat));
  float* out = out32.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinQuantWeightsPerTask / w.K);
  parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = ids[i];
      int q[QuantWeight::kBlock];
      for (int64_t b = 0; b < w.blocks(); ++b) {
        const int64_t g = b * QuantWeight::kBlock / w.group;
        const float d = w.scale(n, g), m = w.bits == 4 ? w.min(n, g) : 0.f;
        w.block_values(n, b, q);
        float* row = out + i * w.K + b * QuantWeight::kBlock;
        for (int64_t kk = 0; kk < QuantWeight::kBlock; ++kk) {
          row[kk] = d * static_cast<float>(q[kk]) + m;
        }
      }
    }
  });
  return dtype == at::kFloat ? out32 : out32.to(dtype);
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int n, str? isa=None, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "quant_linear_argmax(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int n, int n_valid, str? isa=None) -> Tensor");
  m.def(
      "quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, "
      "int n, Tensor? rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quant_linear", &pagedserve::quant_linear);
  m.impl("quant_linear_argmax", &pagedserve::quant_linear_argmax);
  m.impl("quant_dequantize", &pagedserve::quant_dequantize);
}
