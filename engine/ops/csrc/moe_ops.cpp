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
// to split: the experts run one after the other.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "layer_weights.h"

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
  at::parallel_for(0, H, grain, [&](int64_t h0, int64_t h1) {
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
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const int64_t begin = groups.begin[e], count = groups.begin[e + 1] - begin;
    if (count == 0) continue;
    const int64_t* pairs = groups.pairs.data() + begin;
    const at::Tensor rows = expert_rows(x, pairs, count, k);  // (count, H)
    at::Tensor y = linear(silu_and_mul(linear(rows, *w.gate_up[e], isa), isa), *w.down[e], isa);
    TORCH_CHECK(y.is_contiguous() && y.size(1) == H && y.scalar_type() == x.scalar_type(),
                "sparse_moe: an expert's output is not (rows, hidden) in x's dtype");
    dispatch_dtype(x.scalar_type(), "sparse_moe", [&](auto zero) {
      using T = decltype(zero);
      add_scaled(out.data_ptr<T>(), y.data_ptr<T>(), scales.data_ptr<T>(), pairs, count, H, k);
    });
  }
  return out;
}

}  // namespace pagedserve

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("sparse_moe", &pagedserve::sparse_moe);
}
