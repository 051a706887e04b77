// What every paged-attention kernel implementation shares: the walk over a request's
// pages. Compiled into each instruction set's namespace (see kernels.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels.h"

#ifndef PAGEDSERVE_ISA
#error "compile with -DPAGEDSERVE_ISA=<namespace> (see kernels.h)"
#endif

namespace pagedserve::PAGEDSERVE_ISA {

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

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

}  // namespace pagedserve::PAGEDSERVE_ISA
