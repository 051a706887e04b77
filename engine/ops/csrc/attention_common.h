// What every paged-attention kernel implementation shares: the problem, the work items,
// the walk over a request's pages and the per-thread scratch.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace pagedserve {

constexpr int kChunk = 16;  // keys per online-softmax step (one zmm of scores)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct Problem {
  const T* q;  // (num_tokens, num_heads, head_dim), token stride q_stride
  const T* k_cache;  // (num_blocks, block_size, num_kv_heads, head_dim), contiguous
  const T* v_cache;
  T* out;  // like q, token stride out_stride
  int64_t q_stride, out_stride;
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;
  int64_t num_kv_heads, head_dim, block_size, group;
  float scale;
};

// Query rows row_begin..row_end of one request, for the `group` query heads of one KV head.
struct WorkItem {
  int32_t req, kv_head, row_begin, row_end;
  int64_t cost;
};

// Where one request's rows and pages are.
struct Span {
  int64_t q_begin;  // first flat-batch row of the request
  int64_t computed;  // keys cached before this step: query i sits at computed + i
  const int32_t* pages;
};

template <typename T>
Span span_of(const Problem<T>& pb, int64_t r) {
  const int64_t q_len = pb.qo_indptr[r + 1] - pb.qo_indptr[r];
  const int64_t num_pages = pb.kv_indptr[r + 1] - pb.kv_indptr[r];
  const int64_t kv_len = (num_pages - 1) * pb.block_size + pb.kv_last_page_len[r];
  return {pb.qo_indptr[r], kv_len - q_len, pb.kv_indices + pb.kv_indptr[r]};
}

// Walks a request's keys in order, yielding the element offset of each key's row for one
// KV head, without a division per key.
//
//   key t  ->  page pages[t / block_size], row t % block_size
//          ->  offset ((page * block_size + t % block_size) * kv_heads + head) * head_dim
struct PageCursor {
  const int32_t* pages;
  int64_t block_size, row_stride, head_offset;
  int64_t page = 0, offset = 0;

  void next_rows(int n, int64_t* rows) {
    if (offset + n <= block_size) {  // the usual case: the n keys share a page
      const int64_t first = (pages[page] * block_size + offset) * row_stride + head_offset;
      for (int j = 0; j < n; ++j) rows[j] = first + j * row_stride;
      advance(n);
      return;
    }
    for (int j = 0; j < n; ++j) {
      rows[j] = (pages[page] * block_size + offset) * row_stride + head_offset;
      advance(1);
    }
  }

 private:
  void advance(int64_t n) {
    offset += n;
    if (offset == block_size) {
      offset = 0;
      ++page;
    }
  }
};

template <typename T>
PageCursor cursor_for(const Problem<T>& pb, const Span& sp, int64_t kv_head) {
  const int64_t row_stride = pb.num_kv_heads * pb.head_dim;
  return {sp.pages, pb.block_size, row_stride, kv_head * pb.head_dim};
}

// Keys that query row i (of a request with `computed` cached keys) sees in the chunk
// starting at key c holding n keys: at most n, none when the chunk lies in its future.
inline int visible_keys(int64_t computed, int64_t i, int64_t c, int n) {
  return static_cast<int>(std::clamp<int64_t>(computed + i + 1 - c, 0, n));
}

// Scratch owned by one thread for all the items it runs.
struct Scratch {
  std::vector<float> q, acc, p, k, kt, v, row_max, row_sum, alpha;
  std::vector<uint16_t> p16;
  std::vector<const void*> q_rows;
  Scratch(int64_t max_queries, int64_t head_dim)
      : q(max_queries * head_dim), acc(max_queries * head_dim), p(max_queries * kChunk),
        k(kChunk * head_dim), kt(kChunk * head_dim), v(kChunk * head_dim), row_max(max_queries),
        row_sum(max_queries), alpha(max_queries), p16(max_queries * kChunk),
        q_rows(max_queries) {}
};

// Calls f(T{}) for the element type T of a float32, bfloat16 or float16 tensor.
template <typename F>
void dispatch_dtype(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::kFloat: return f(float{});
    case c10::kBFloat16: return f(c10::BFloat16{});
    case c10::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

}  // namespace pagedserve
