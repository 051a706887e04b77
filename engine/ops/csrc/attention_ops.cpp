// Batched varlen paged attention on the CPU, with FlashInfer's paged-prefill semantics.
//
// Request r owns query rows qo_indptr[r]..qo_indptr[r+1] of the flat batch and the pages
// kv_indices[kv_indptr[r]..kv_indptr[r+1]] of an NHD cache (blocks, block_size, kv_heads,
// head_dim). Its KV length is (pages - 1) * block_size + kv_last_page_len[r], and query i
// of its q_len rows sits at position kv_len - q_len + i and sees keys 0..kv_len - q_len + i
// (with a sliding window of w keys, only the last w of those: Problem::window).
//
// Work is split into items (request, kv_head, tile of query rows; a long decode's keys also
// into parts, merged at the end: see kSplitMinKeys). An item loads each key/value row once,
// for all `group` query heads of its KV head and all rows of its tile, and streams over the
// keys kChunk (32) at a time with an online softmax in float32:
//
//   for each chunk of 32 keys:   s = q.K^T * scale            (M, 32)   M = rows * group
//                                m' = max(m, rowmax(s)); p = exp(s - m'); alpha = exp(m - m')
//                                l = l * alpha + rowsum(p);  acc = acc * alpha + p.V
//   out = acc / l
//
// The item kernels (attention_kernels.cpp) exist once per instruction set; this file,
// compiled for the baseline CPU, checks the inputs, plans the items, runs them on torch's
// thread pool and dispatches each to the chosen set (kernels.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "attention_common.h"
#include "kernels.h"
#include "parallel.h"

namespace pagedserve {
namespace {

using PAGEDSERVE_ISA::chunk_aligned_keys;
using PAGEDSERVE_ISA::denominator;
using PAGEDSERVE_ISA::first_walked_key;
using PAGEDSERVE_ISA::part_state;
using PAGEDSERVE_ISA::span_of;

constexpr int64_t kTileQueries = 48;  // query vectors (rows * group) per work item
// Keys requests must share, page for page, to be read once for all of them.
constexpr int64_t kMinSharedKeys = 128;
// A chunk's keys of an item's KV heads, widened to float32, stay within this (L1-sized).
constexpr int64_t kMaxChunkBytes = 32 * 1024;
// Requests per thread from which a decode's KV heads share one item: fewer items are then
// still enough to keep every thread busy.
constexpr int64_t kGroupHeadsMinRequests = 4;
// A decode over at least kSplitMinKeys keys is split into parts of about kPartKeys keys (at
// most kMaxParts), each an item of its own over all the KV heads that fit one item, and the
// parts' states are merged after. A single decode then keeps every thread busy (one item
// per head left a thread idle: 3 heads on 2 threads), and each item reads its keys' rows
// of all heads, which lie side by side, as one stream (one head's rows are a third of each
// key's, read with gaps). In a Q4_1 SmolLM2 decode step on 2 AVX2 threads
// (benchmarks/decode_breakdown.py), attention at 900 keys took a mean 2.61 ms split so,
// against 2.71 unsplit with one item per head, in six alternating pairs (the machine's noise
// was as large); at 200 keys, split in two, it gained nothing, and in a batch of 64 decodes
// of 250 keys splitting cost 5-10% (benchmarks/attention_cpu.py): shorter decodes stay
// whole. The split depends only on the request's own length and the block size, never on
// the batch, so a request gives the same result alone or in a batch (unsplit, the same keys
// in one pass round differently).
constexpr int64_t kSplitMinKeys = 512;
constexpr int64_t kPartKeys = 128;

// ---------------------------------------------------------------------------------------
// Planning and threading.

// Query rows per item: enough query vectors to amortise each K/V row load, few enough that
// one long prefill splits into many items for the threads to share.
int64_t rows_per_tile(int64_t group) { return std::max<int64_t>(1, kTileQueries / group); }

// The most KV heads one item of q_len query rows takes: its query vectors and chunk scratch.
template <typename T>
int64_t max_heads_per_item(const Problem<T>& pb, int64_t q_len) {
  const int64_t by_scratch = kMaxChunkBytes / (kChunk * pb.head_dim * int64_t{sizeof(float)});
  const int64_t by_queries = kTileQueries / (q_len * pb.group);
  return std::clamp<int64_t>(std::min(by_scratch, by_queries), 1, pb.num_kv_heads);
}

// KV heads per item for an unsplit request of q_len query rows: the most for a decode in a
// batch of many requests; else one (a split decode's parts take the most: plan_items).
template <typename T>
int64_t heads_per_item(const Problem<T>& pb, int64_t num_reqs, int64_t q_len) {
  if (num_reqs < kGroupHeadsMinRequests * at::get_num_threads()) return 1;
  return max_heads_per_item(pb, q_len);
}

// Requests req_begin..req_end (consecutive, so their rows are too) whose first `keys` keys
// sit on the same pages, and which all see those keys in full.
struct SharedPrefix {
  int64_t req_begin, req_end, keys;
};

// Runs of consecutive requests that share leading pages (a common system prompt, cached
// once by the prefix cache). Their shared keys, in whole pages and whole chunks
// (chunk_aligned_keys), are read once for all of them, by items over all their rows, and
// each request then resumes from there. Online softmax walks the keys in the same chunks
// either way, so the AVX-512 kernels give the same result bit for bit (the portable one
// may sum a score in another order).
template <typename T>
std::vector<SharedPrefix> find_shared_prefixes(const Problem<T>& pb, int64_t num_reqs) {
  std::vector<SharedPrefix> runs;
  // With a sliding window, rows do not see a shared prefix in full.
  if (pb.window > 0) return runs;
  const int32_t* pages = pb.kv_indices;
  // Pages of request r that every one of its rows sees in full.
  auto seen_pages = [&](int64_t r) { return span_of(pb, r).computed / pb.block_size; };
  auto q_len = [&](int64_t r) { return pb.qo_indptr[r + 1] - pb.qo_indptr[r]; };
  const int64_t align = chunk_aligned_keys(pb.block_size);
  // At least kMinSharedKeys keys once cut to whole chunks.
  const int64_t min_pages = (kMinSharedKeys + align - 1) / align * align / pb.block_size;
  int64_t r0 = 0;
  while (r0 < num_reqs) {
    int64_t shared = q_len(r0) > 0 ? seen_pages(r0) : 0, r1 = r0 + 1;
    for (; r1 < num_reqs && q_len(r1) > 0; ++r1) {
      const int32_t* a = pages + pb.kv_indptr[r0];
      const int32_t* b = pages + pb.kv_indptr[r1];
      const int64_t limit = std::min(shared, seen_pages(r1));
      int64_t common = 0;
      while (common < limit && a[common] == b[common]) ++common;
      if (common < min_pages) break;
      shared = common;
    }
    if (r1 - r0 >= 2 && shared >= min_pages) {
      runs.push_back({r0, r1, shared * pb.block_size / align * align});
    }
    r0 = r1;
  }
  return runs;
}

// The items of one pass, longest first: they are handed out dynamically, which balances
// them without knowing the thread count.
void sort_by_cost(std::vector<WorkItem>& items) {
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
}

// Items over each shared prefix: all the rows of its requests, for each KV head. The rows
// are cut into enough tiles to give every thread work, even for a few decodes.
template <typename T>
std::vector<WorkItem> plan_shared_items(const Problem<T>& pb,
                                        const std::vector<SharedPrefix>& runs) {
  std::vector<WorkItem> items;
  const int64_t threads = at::get_num_threads();
  for (const SharedPrefix& run : runs) {
    const int64_t rows = pb.qo_indptr[run.req_end] - pb.qo_indptr[run.req_begin];
    const int64_t tiles = std::min(
        rows, std::max((rows + rows_per_tile(pb.group) - 1) / rows_per_tile(pb.group),
                       (2 * threads + pb.num_kv_heads - 1) / pb.num_kv_heads));
    const int64_t tile_rows = (rows + tiles - 1) / tiles;
    for (int64_t i0 = 0; i0 < rows; i0 += tile_rows) {
      const int64_t i1 = std::min(rows, i0 + tile_rows);
      for (int64_t h = 0; h < pb.num_kv_heads; ++h) {
        WorkItem item{static_cast<int32_t>(run.req_begin), static_cast<int32_t>(h),
                      static_cast<int32_t>(i0), static_cast<int32_t>(i1)};
        item.shared_keys = static_cast<int32_t>(run.keys);
        item.cost = (i1 - i0) * pb.group * run.keys + 256;
        items.push_back(item);
      }
    }
  }
  sort_by_cost(items);
  return items;
}

// A split decode: its query row (in the flat batch) and how many parts its keys are in.
struct SplitDecode {
  int64_t row, parts;
};

// The keys per part of a decode over kv_len keys (whole pages and whole chunks), or
// 0 if it is not split. With a sliding window, kv_len counts the keys from the page its
// window starts in.
int64_t part_keys(int64_t kv_len, int64_t block_size) {
  if (kv_len < kSplitMinKeys) return 0;
  const int64_t parts = std::min<int64_t>(kMaxParts, kv_len / kPartKeys);
  const int64_t align = chunk_aligned_keys(block_size);
  const int64_t keys = ((kv_len + parts - 1) / parts + align - 1) / align * align;
  return keys < kv_len ? keys : 0;
}

// Every request's items, each starting after its shared prefix if it has one; a long
// decode's in parts, which `splits` lists.
template <typename T>
std::vector<WorkItem> plan_items(const Problem<T>& pb, int64_t num_reqs,
                                 const std::vector<SharedPrefix>& runs,
                                 std::vector<SplitDecode>& splits) {
  std::vector<int64_t> key_begin(num_reqs, 0);
  for (const SharedPrefix& run : runs) {
    std::fill(key_begin.begin() + run.req_begin, key_begin.begin() + run.req_end, run.keys);
  }
  std::vector<WorkItem> items;
  const int64_t rows = rows_per_tile(pb.group);
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = pb.qo_indptr[r + 1] - pb.qo_indptr[r];
    const int64_t computed = span_of(pb, r).computed;
    // Keys before `first` lie outside the window of every query row of the request.
    const int64_t first = first_walked_key(computed, 0, pb.window, pb.block_size);
    const int64_t split_keys =
        q_len == 1 && key_begin[r] == 0 ? part_keys(computed + 1 - first, pb.block_size) : 0;
    if (split_keys > 0) {
      const int64_t kv_len = computed + 1, heads = max_heads_per_item(pb, 1);
      const auto split = static_cast<int32_t>(splits.size());
      splits.push_back({pb.qo_indptr[r], (kv_len - first + split_keys - 1) / split_keys});
      for (int64_t k0 = first, part = 0; k0 < kv_len; k0 += split_keys, ++part) {
        const int64_t k1 = std::min(kv_len, k0 + split_keys);
        for (int64_t h = 0; h < pb.num_kv_heads; h += heads) {
          WorkItem item{static_cast<int32_t>(r), static_cast<int32_t>(h), 0, 1};
          item.kv_heads = static_cast<int32_t>(std::min(heads, pb.num_kv_heads - h));
          item.key_begin = static_cast<int32_t>(k0);
          item.key_end = static_cast<int32_t>(k1);
          item.part = static_cast<int32_t>(part);
          item.split = split;
          item.cost = pb.group * heads * (k1 - k0) + 256;
          items.push_back(item);
        }
      }
      continue;
    }
    for (int64_t i0 = 0; i0 < q_len; i0 += rows) {
      const int64_t i1 = std::min(q_len, i0 + rows);
      // Key rows visited times query vectors, plus a fixed cost per item.
      const int64_t heads = heads_per_item(pb, num_reqs, i1 - i0);
      const int64_t walked =
          computed + i1 - std::max(key_begin[r], first_walked_key(computed, i0, pb.window,
                                                                  pb.block_size));
      const int64_t cost = (i1 - i0) * pb.group * heads * walked + 256;
      for (int64_t h = 0; h < pb.num_kv_heads; h += heads) {
        WorkItem item{static_cast<int32_t>(r), static_cast<int32_t>(h),
                      static_cast<int32_t>(i0), static_cast<int32_t>(i1)};
        item.key_begin = static_cast<int32_t>(key_begin[r]);
        item.kv_heads = static_cast<int32_t>(std::min(heads, pb.num_kv_heads - h));
        item.cost = cost;
        items.push_back(item);
      }
    }
  }
  sort_by_cost(items);
  return items;
}

// Runs the items on torch's thread pool, one task per thread, each pulling items until
// none are left (parallel_for hands out static ranges, which would leave a thread idle
// behind a long prefill).
template <typename T>
void run_items(const Problem<T>& pb, const std::vector<WorkItem>& items, const Kernels& kernels) {
  if (items.empty()) return;
  const auto attention_item = kernels.of<T>().attention_item;
  const int64_t max_queries = std::max(rows_per_tile(pb.group) * pb.group, kTileQueries);
  int32_t max_heads = 1;
  for (const WorkItem& item : items) max_heads = std::max(max_heads, item.kv_heads);
  const int64_t num_workers =
      std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  std::atomic<int64_t> next{0};
  parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;  // kept between calls: no allocation per layer
    scratch.reserve(max_queries, pb.head_dim, max_heads);
    const auto count = static_cast<int64_t>(items.size());
    for (int64_t w = begin; w < end; ++w) {
      // Each thread claims its next item before it runs the current one, whose last keys
      // then request the next one's first.
      for (int64_t idx = next.fetch_add(1), after = 0; idx < count; idx = after) {
        after = next.fetch_add(1);
        scratch.next = after < count ? &items[after] : nullptr;
        attention_item(pb, items[idx], scratch);
      }
    }
  });
}

// Each split decode's output from its parts' states: the online softmax's merge, in part
// order, for every head.
template <typename T>
void merge_parts(const Problem<T>& pb, const std::vector<SplitDecode>& splits) {
  const int64_t D = pb.head_dim, num_heads = pb.num_kv_heads * pb.group;
  for (size_t s = 0; s < splits.size(); ++s) {
    const SplitDecode& split = splits[s];
    for (int64_t head = 0; head < num_heads; ++head) {
      const float* first = part_state(pb, static_cast<int64_t>(s), head, 0);
      float mx = kNegInf;
      for (int64_t p = 0; p < split.parts; ++p) mx = std::max(mx, first[p * (D + 2) + D]);
      float weight[kMaxParts], sum = 0.f;
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* st = first + p * (D + 2);
        weight[p] = std::exp(st[D] - mx);
        sum += st[D + 1] * weight[p];
      }
      const float inv = 1.0f / denominator(pb, head, mx, sum);
      T* dst = pb.out + split.row * pb.out_stride + head * D;
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t p = 0; p < split.parts; ++p) acc += first[p * (D + 2) + d] * weight[p];
        dst[d] = static_cast<T>(acc * inv);
      }
    }
  }
}

template <typename T>
void run(Problem<T> pb, int64_t num_reqs, int64_t num_tokens, const Kernels& kernels) {
  const std::vector<SharedPrefix> runs = find_shared_prefixes(pb, num_reqs);
  if (!runs.empty()) {
    // The shared prefixes' states, per (token, head): acc[head_dim], max, sum.
    thread_local std::vector<float> states;
    const int64_t num_heads = pb.num_kv_heads * pb.group;
    states.resize(std::max<size_t>(states.size(), num_tokens * num_heads * (pb.head_dim + 2)));
    pb.state = states.data();
    run_items(pb, plan_shared_items(pb, runs), kernels);
  }
  std::vector<SplitDecode> splits;
  const std::vector<WorkItem> items = plan_items(pb, num_reqs, runs, splits);
  if (!splits.empty()) {
    thread_local std::vector<float> parts;
    const int64_t num_heads = pb.num_kv_heads * pb.group;
    const size_t size = splits.size() * num_heads * kMaxParts * (pb.head_dim + 2);
    parts.resize(std::max(parts.size(), size));
    pb.parts = parts.data();
  }
  run_items(pb, items, kernels);
  merge_parts(pb, splits);
}

void check_metadata(const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                    const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                    int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
  for (const at::Tensor* t : {&qo_indptr, &kv_indptr, &kv_indices, &kv_last_page_len}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous() &&
                    t->dim() == 1,
                "paged_attention: index tensors must be contiguous 1-D int32 CPU tensors");
  }
  const int64_t num_reqs = kv_last_page_len.size(0);
  TORCH_CHECK(qo_indptr.size(0) == num_reqs + 1 && kv_indptr.size(0) == num_reqs + 1,
              "paged_attention: qo_indptr and kv_indptr need num_reqs + 1 entries");
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kv = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK(qo[0] == 0 && kv[0] == 0, "paged_attention: indptr arrays must start at 0");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = qo[r + 1] - qo[r], pages = kv[r + 1] - kv[r];
    TORCH_CHECK(q_len >= 0 && pages >= 0, "paged_attention: indptr arrays must not decrease");
    if (q_len == 0) continue;
    TORCH_CHECK(pages > 0 && last[r] >= 1 && last[r] <= block_size,
                "paged_attention: request ", r, " has queries but no valid last page");
    TORCH_CHECK((pages - 1) * block_size + last[r] >= q_len,
                "paged_attention: request ", r, " has more queries than keys");
  }
  TORCH_CHECK(qo[num_reqs] <= num_tokens, "paged_attention: qo_indptr exceeds the query rows");
  TORCH_CHECK(kv[num_reqs] <= kv_indices.size(0), "paged_attention: kv_indptr exceeds kv_indices");
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
  for (int64_t p = 0; p < kv[num_reqs]; ++p) {
    TORCH_CHECK(idx[p] >= 0 && idx[p] < num_blocks, "paged_attention: page id ", idx[p],
                " is outside the cache's ", num_blocks, " blocks");
  }
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& qo_indptr,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                     const at::Tensor& kv_last_page_len, double scale,
                     const std::optional<std::string>& isa, int64_t window,
                     const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be 0 (none) or positive");
  TORCH_CHECK(!sinks.has_value() ||
                  (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                   sinks->is_contiguous() && sinks->dim() == 1 && sinks->size(0) == q.size(1)),
              "paged_attention: sinks must be a contiguous float32 CPU tensor of num_heads");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(),
              "paged_attention: q and out must be (T, H, D)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous ",
              "(blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q, out and the caches must share one dtype");
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu(),
              "paged_attention: this kernel runs on CPU tensors");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "paged_attention: head_dim mismatch, or num_heads not a multiple of num_kv_heads");
  for (const at::Tensor* t : {&q, &out}) {
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D,
                "paged_attention: each token's (H, D) rows of q and out must be contiguous");
  }
  check_metadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, q.size(0), k_cache.size(0),
                 k_cache.size(1));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> pb{q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        out.data_ptr<T>(), q.stride(0), out.stride(0),
                        qo_indptr.data_ptr<int32_t>(), kv_indptr.data_ptr<int32_t>(),
                        kv_indices.data_ptr<int32_t>(), kv_last_page_len.data_ptr<int32_t>(),
                        Hkv, D, k_cache.size(1), H / Hkv, static_cast<float>(scale),
                        nullptr};
    pb.window = window;
    pb.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
    run(pb, kv_last_page_len.size(0), q.size(0), kernels_for(isa));
  };
  dispatch_dtype(q.scalar_type(), "paged_attention", launch);
}

// The shared prefixes paged_attention finds in a batch, as rows (req_begin, req_end, keys).
at::Tensor shared_prefixes(const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                           const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                           int64_t block_size) {
  TORCH_CHECK(block_size > 0, "shared_prefixes: block_size must be positive");
  const int64_t num_tokens = qo_indptr.size(0) > 0 ? qo_indptr[-1].item<int64_t>() : 0;
  check_metadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_tokens,
                 std::numeric_limits<int32_t>::max(), block_size);
  Problem<float> pb{};
  pb.qo_indptr = qo_indptr.data_ptr<int32_t>();
  pb.kv_indptr = kv_indptr.data_ptr<int32_t>();
  pb.kv_indices = kv_indices.data_ptr<int32_t>();
  pb.kv_last_page_len = kv_last_page_len.data_ptr<int32_t>();
  pb.block_size = block_size;
  const auto runs = find_shared_prefixes(pb, kv_last_page_len.size(0));
  at::Tensor out = at::empty({static_cast<int64_t>(runs.size()), 3}, at::kLong);
  for (size_t i = 0; i < runs.size(); ++i) {
    out[i][0] = runs[i].req_begin;
    out[i][1] = runs[i].req_end;
    out[i][2] = runs[i].keys;
  }
  return out;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "shared_prefixes(Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, int block_size) -> Tensor");
  // isa: run this instruction set's kernels instead of the CPU's best (for tests). window:
  // a sliding window of that many keys (0: none; see Problem::window). sinks: a float32
  // logit per query head in each softmax's denominator (Problem::sinks).
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, "
      "float scale, str? isa=None, int window=0, Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_attention", &pagedserve::paged_attention);
  m.impl("shared_prefixes", &pagedserve::shared_prefixes);
}
