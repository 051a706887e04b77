// The batched LoRA op's entry point (kernels in lora_kernels.cpp): tensor checks, the
// step's segments as rows, and the split of rows over torch's threads.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// Rows per parallel task: at least this many multiply-adds, so a decode step's few rows
// stay on one thread unless there is enough work for two.
constexpr int64_t kMinMacsPerTask = 1 << 16;

// y (T, N) += (x (T, K) a[slot]^T) bt[slot] over the rows of each segment: rows
// bounds[2i]..bounds[2i + 1] use slots[i]. a is (slots, R, K) and bt (slots, R, N), in
// `blocks` blocks of R / blocks rows of which the first ranks[slot] are used, block b's
// covering output columns col_offsets[b]..col_offsets[b + 1].
void lora_apply(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                const at::Tensor& bt, const at::Tensor& ranks, at::IntArrayRef col_offsets,
                at::IntArrayRef bounds, at::IntArrayRef slots,
                const std::optional<std::string>& isa) {
  const int64_t blocks = static_cast<int64_t>(col_offsets.size()) - 1;
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) &&
                  y.stride(1) == 1 && x.stride(1) == 1,
              "lora_apply: y and x must be CPU (rows, features) tensors with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous() &&
                  a.size(0) == bt.size(0) && a.size(1) == bt.size(1) && a.size(2) == x.size(1) &&
                  bt.size(2) == y.size(1),
              "lora_apply: a must be (slots, R, K) and bt (slots, R, N), contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(),
              "lora_apply: y, x, a and bt must share a dtype");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() &&
                  ranks.numel() == a.size(0),
              "lora_apply: ranks must hold one int64 per slot");
  const int64_t R = a.size(1), K = a.size(2), N = bt.size(2), num_slots = a.size(0);
  TORCH_CHECK(blocks >= 1 && R % blocks == 0, "lora_apply: R must be whole blocks");
  TORCH_CHECK(col_offsets[0] == 0 && col_offsets[blocks] <= N, "lora_apply: bad col_offsets");
  for (int64_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(col_offsets[b] <= col_offsets[b + 1], "lora_apply: bad col_offsets");
  }
  TORCH_CHECK(bounds.size() == 2 * slots.size(), "lora_apply: two bounds per slot entry");
  const int64_t* rank = ranks.data_ptr<int64_t>();
  std::vector<int64_t> item_rows, item_counts, item_slots;
  int64_t max_rank = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "lora_apply: slot ", slot, " out of range");
    TORCH_CHECK(rank[slot] >= 0 && rank[slot] <= R / blocks, "lora_apply: bad rank");
    TORCH_CHECK(0 <= bounds[2 * i] && bounds[2 * i] <= bounds[2 * i + 1] &&
                    bounds[2 * i + 1] <= y.size(0),
                "lora_apply: segment out of range");
    max_rank = std::max(max_rank, rank[slot]);
    for (int64_t r = bounds[2 * i]; r < bounds[2 * i + 1]; r += kLoRARowsPerItem) {
      item_rows.push_back(r);
      item_counts.push_back(std::min(kLoRARowsPerItem, bounds[2 * i + 1] - r));
      item_slots.push_back(slot);
    }
  }
  if (item_rows.empty()) return;
  const int64_t macs = std::max<int64_t>(1, kLoRARowsPerItem * max_rank * blocks * (K + N));
  const int64_t grain = std::max<int64_t>(1, kMinMacsPerTask / macs);
  dispatch_dtype(y.scalar_type(), "lora_apply", [&](auto tag) {
    using T = decltype(tag);
    const LoRARows<T> args{y.data_ptr<T>(),    y.stride(0),       x.data_ptr<T>(),
                           x.stride(0),        a.data_ptr<T>(),   bt.data_ptr<T>(),
                           K,                  N,                 R,
                           blocks,             rank,              col_offsets.data(),
                           item_rows.data(),   item_counts.data(), item_slots.data()};
    const auto kernel = kernels_for(isa).of<T>().lora_rows;
    parallel_for(0, static_cast<int64_t>(item_rows.size()), grain,
                     [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor bt, Tensor ranks, int[] col_offsets, "
      "int[] bounds, int[] slots, str? isa=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("lora_apply", &lora_apply); }

}  // namespace pagedserve
