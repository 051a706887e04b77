// A sparse mixture-of-experts MLP (engine/models/moe.py's SparseMoE) as one op on the CPU.
//
// SparseMoE.forward routes in torch and runs each chosen expert from Python: some ten
// small torch calls to route, and six more for every expert a step chose, each a few
// microseconds of Python dispatch; at one token per step that rivals the experts'
// arithmetic. This op makes the same computation from C++: the routing with the same torch
// ops (so the same experts and weights, to the bit), then, for each chosen expert in
// ascending order, its two projections once on all of its tokens through the linear
// kernels of its weight's kind (decoder_ops.cpp's linear: bfloat16 tiles, oneDNN-packed,
// float, quantized), and each token's sum in the same order and with the same roundings as
// SparseMoE.forward, so the output equals the Python path's.
//
// The threads split each expert's projections (the linear kernels split their output tiles
// over torch's threads), which at a decode step's single token is the only work there is
// to split. With bfloat16 tiles (every expert's weights laid out for bf16_linear), every
// chosen expert's gate/up projection runs in one parallel region, and every down projection
// in another: a thread that finishes its share of one expert's tiles goes on to claim the
// next expert's (parallel.h's TileClaims), so the threads meet twice a layer, not twice an
// expert, and a thread that the OS holds back delays only the tiles it holds.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "layer_weights.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// A step's (token, expert) pairs grouped by expert, as SparseMoE.forward's stable argsort
// of the chosen experts lays them out: expert e's pairs are pairs[begin[e]..begin[e + 1]),
// each the flat index t * top_k + j of token t's j-th pick, tokens ascending.
struct Groups {
  std::vector<int64_t> begin, pairs;
};

Groups group_by_expert(const at::Tensor& chosen, int64_t num_experts) {
  const int64_t n = chosen.numel();
  const int64_t* expert = chosen.data_ptr<int64_t>();
  Groups g{std::vector<int64_t>(num_experts + 1, 0), std::vector<int64_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(expert[i] >= 0 && expert[i] < num_experts, "sparse_moe: expert out of range");
    ++g.begin[expert[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.begin[e + 1] += g.begin[e];
  std::vector<int64_t> next(g.begin.begin(), g.begin.end() - 1);
  for (int64_t i = 0; i < n; ++i) g.pairs[next[expert[i]]++] = i;
  return g;
}

// The rows of x (T, H) that an expert's pairs route to it: x itself when they are every
// token in order (one token, or every token chose it), else a gathered copy.
at::Tensor expert_rows(const at::Tensor& x, const int64_t* pairs, int64_t count, int64_t top_k) {
  const int64_t T = x.size(0);
  if (count == T) return x;  // a token picks an expert at most once, so these are 0..T-1
  at::Tensor rows = at::empty({count, x.size(1)}, x.options());
  const int64_t bytes = x.size(1) * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(rows.data_ptr());
  for (int64_t r = 0; r < count; ++r) {
    std::memcpy(dst + r * bytes, src + (pairs[r] / top_k) * bytes, bytes);
  }
  return rows;
}

// out[token of pair r] += y[r] * scale[pair r], for an expert's rows, rounding as
// SparseMoE.forward does: the product to T (the `y * scales` tensor), then the sum to T
// (index_add_). The two are separate passes, so no compiler fuses them into one FMA, which
// would skip the product's rounding. The threads split the hidden columns: no two write
// the same element.
template <typename T>
void add_scaled(T* out, T* y, const T* scale, const int64_t* pairs, int64_t count, int64_t H,
                int64_t top_k) {
  constexpr int64_t kMinElements = 1 << 15;  // per thread: enough to pay for a fork
  const int64_t grain = std::max<int64_t>(1, kMinElements / std::max<int64_t>(1, count));
  parallel_for(0, H, grain, [&](int64_t h0, int64_t h1) {
    for (int64_t r = 0; r < count; ++r) {
      T* yr = y + r * H;
      const float s = static_cast<float>(scale[pairs[r]]);
      for (int64_t h = h0; h < h1; ++h) yr[h] = static_cast<T>(static_cast<float>(yr[h]) * s);
    }
    for (int64_t r = 0; r < count; ++r) {
      const T* yr = y + r * H;
      T* o = out + (pairs[r] / top_k) * H;
      for (int64_t h = h0; h < h1; ++h) {
        o[h] = static_cast<T>(static_cast<float>(o[h]) + static_cast<float>(yr[h]));
      }
    }
  });
}

// A chosen expert: its index, its pairs (Groups), their rows of x, its output rows.
struct Chosen {
  int64_t expert;
  const int64_t* pairs;
  int64_t count;
  at::Tensor rows, y;  // (count, H) each
};

// One projection of a chosen expert on bfloat16 tiles: y (M, N) = x (M, K) W^T.
struct TiledGemm {
  Bf16Weight w;
  const c10::BFloat16* x;
  int64_t M;
  c10::BFloat16* y;
};

// Whether every chosen expert's projections are plain bfloat16 tiles (no bias), for
// tiled_gemms.
bool all_tiled(const MoeWeights& w, const std::vector<Chosen>& chosen, const at::Tensor& x) {
  if (x.scalar_type() != at::kBFloat16) return false;
  for (const Chosen& c : chosen) {
    for (const auto* lw : {w.gate_up[c.expert].get(), w.down[c.expert].get()}) {
      if (lw->kind != kTiled || lw->bias.has_value()) return false;
    }
  }
  return true;
}

// The gemm of x (M, K) and the tiled weight, y allocated here: the checks of bf16_linear.
TiledGemm tiled_gemm(const LinearWeights& lw, const at::Tensor& x, at::Tensor& y) {
  const at::Tensor& t = lw.weight;
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.size(2) == Bf16Weight::kTile &&
                  t.size(3) == 2 && t.scalar_type() == at::kBFloat16 &&
                  x.size(1) == 2 * t.size(1) && x.is_contiguous(),
              "sparse_moe: an expert's tiled weight does not fit its input");
  y = at::empty({x.size(0), lw.n}, x.options());
  const Bf16Weight w{t.data_ptr<c10::BFloat16>(), lw.n, 2 * t.size(1)};
  return {w, x.data_ptr<c10::BFloat16>(), x.size(0), y.data_ptr<c10::BFloat16>()};
}

// Every gemm in one parallel region: each thread claims runs of the first gemm's tiles
// until none are left, then of the next one's. A decode step's runs are a thread's whole
// share of a gemm (kClaimFlops, as parallel_tiles), so each thread streams its own part of
// each expert's weights; at more rows, the runs shorten.
void tiled_gemms(const std::vector<TiledGemm>& gemms, const Kernels& kernels) {
  const int64_t threads = at::get_num_threads();
  std::vector<std::unique_ptr<TileClaims>> claims;  // TileClaims holds an atomic
  for (const TiledGemm& g : gemms) {
    const int64_t tiles = g.w.tiles(), share = (tiles + threads - 1) / threads;
    const int64_t flops_per_tile = 2 * g.M * g.w.K * Bf16Weight::kTile;
    const int64_t min_chunk = std::min(share, kClaimFlops / std::max<int64_t>(1, flops_per_tile));
    claims.push_back(std::make_unique<TileClaims>(0, tiles, min_chunk, threads));
  }
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (size_t g = 0; g < gemms.size(); ++g) {
        kernels.bf16_tiles(gemms[g].w, gemms[g].x, gemms[g].M, Bf16Out{gemms[g].y}, *claims[g]);
      }
    }
  });
}

// Every chosen expert's SwiGLU MLP on its rows, into Chosen::y: on bfloat16 tiles, all the
// experts' gate/up projections in one parallel region and all their down projections in
// another; otherwise one expert at a time, each projection through linear.
void run_experts(const MoeWeights& w, std::vector<Chosen>& chosen, const OptString& isa) {
  if (!all_tiled(w, chosen, chosen.front().rows)) {
    for (Chosen& c : chosen) {
      const at::Tensor gate_up = linear(c.rows, *w.gate_up[c.expert], isa);
      c.y = linear(silu_and_mul(gate_up, isa), *w.down[c.expert], isa);
    }
    return;
  }
  const Kernels& kernels = kernels_for(isa);
  std::vector<at::Tensor> gate_up(chosen.size()), act(chosen.size());
  std::vector<TiledGemm> gemms;
  for (size_t i = 0; i < chosen.size(); ++i) {
    gemms.push_back(tiled_gemm(*w.gate_up[chosen[i].expert], chosen[i].rows, gate_up[i]));
  }
  tiled_gemms(gemms, kernels);
  gemms.clear();
  for (size_t i = 0; i < chosen.size(); ++i) {
    act[i] = silu_and_mul(gate_up[i], isa);
    gemms.push_back(tiled_gemm(*w.down[chosen[i].expert], act[i], chosen[i].y));
  }
  tiled_gemms(gemms, kernels);
}

// SparseMoE.forward's routing, with its torch ops: (the chosen experts (T, top_k) int64,
// their routing weights (T, top_k) in x's dtype).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const MoeWeights& w,
                                         const OptString& isa) {
  const at::Tensor probs = at::softmax(linear(x, *w.router, isa), -1, at::kFloat);
  auto [weights, chosen] = at::topk(probs, w.top_k, -1);
  if (w.norm_topk_prob) weights = weights / weights.sum(-1, true);
  return {chosen.contiguous(), weights.to(x.scalar_type()).contiguous()};
}

}  // namespace

at::Tensor sparse_moe(const at::Tensor& x, const c10::intrusive_ptr<MoeWeights>& weights,
                      const OptString& isa) {
  const MoeWeights& w = *weights;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "sparse_moe: x must be a contiguous CPU (tokens, hidden) tensor");
  TORCH_CHECK(w.top_k <= w.num_experts(), "sparse_moe: top_k exceeds the experts");
  const int64_t H = x.size(1), k = w.top_k;
  at::Tensor out = at::zeros_like(x);
  if (x.size(0) == 0) return out;
  at::Tensor chosen, scales;  // (T, top_k) each
  std::tie(chosen, scales) = route(x, w, isa);
  const Groups groups = group_by_expert(chosen, w.num_experts());
  std::vector<Chosen> experts;  // ascending
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const int64_t begin = groups.begin[e], count = groups.begin[e + 1] - begin;
    if (count == 0) continue;
    const int64_t* pairs = groups.pairs.data() + begin;
    experts.push_back({e, pairs, count, expert_rows(x, pairs, count, k), at::Tensor()});
  }
  run_experts(w, experts, isa);
  for (const Chosen& c : experts) {
    const at::Tensor& y = c.y;
    TORCH_CHECK(y.is_contiguous() && y.size(1) == H && y.scalar_type() == x.scalar_type(),
                "sparse_moe: an expert's output is not (rows, hidden) in x's dtype");
    dispatch_dtype(x.scalar_type(), "sparse_moe", [&](auto zero) {
      using T = decltype(zero);
      add_scaled(out.data_ptr<T>(), y.data_ptr<T>(), scales.data_ptr<T>(), c.pairs, c.count,
                 H, k);
    });
  }
  return out;
}

}  // namespace pagedserve

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("sparse_moe", &pagedserve::sparse_moe);
}
