// What every paged-attention kernel implementation shares: the walk over a request's
// pages. Compiled into each instruction set's namespace (see kernels.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>

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

  // The next n keys' rows, page by page (a chunk spans pages where blocks are smaller).
  void next_rows(int n, int64_t* rows) {
    for (int j = 0; j < n;) {
      const int take = static_cast<int>(std::min<int64_t>(n - j, block_size - offset));
      const int64_t first = (pages[page] * block_size + offset) * row_stride + head_offset;
      for (int t = 0; t < take; ++t) rows[j + t] = first + t * row_stride;
      j += take;
      offset += take;
      if (offset == block_size) {
        offset = 0;
        ++page;
      }
    }
  }
};

// Keys in whole pages and whole chunks: where a walk over a request's keys may start, so
// that its chunks lie on the same grid (keys 0, kChunk, 2 kChunk, ...) whatever the item.
inline int64_t chunk_aligned_keys(int64_t block_size) {
  return std::lcm<int64_t>(block_size, kChunk);
}

// A cursor at key first_key, which starts a page (first_walked_key, part and shared-prefix
// boundaries all do).
template <typename T>
PageCursor cursor_for(const Problem<T>& pb, const Span& sp, int64_t kv_head, int64_t first_key) {
  const int64_t row_stride = pb.num_kv_heads * pb.head_dim;
  PageCursor cursor{sp.pages, pb.block_size, row_stride, kv_head * pb.head_dim};
  cursor.page = first_key / pb.block_size;
  return cursor;
}

// Elements of S in a 64-byte cache line.
template <typename S>
constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(S));

// Where row j of a chunk lies: rows[j] elements from base (rows in the cache), or, without
// rows, j * stride from base (a chunk widened into scratch, whose fixed stride the
// addressing takes for free once the kernel is inlined with a constant stride).
template <typename S>
struct ChunkRows {
  const S* base;
  const int64_t* rows;
  int64_t stride;
  // The rows of the chunk to be read after this one, whose lines are requested into L1 one
  // at a time as this chunk's are read (request_ahead), or nullptr.
  const int64_t* ahead = nullptr;

  const S* operator[](int j) const { return rows != nullptr ? base + rows[j] : base + j * stride; }

  // Requests the line that holds element `at` of the next chunk's row j, where the kernel
  // has just read element `at` of this chunk's row j.
  PAGEDSERVE_INLINE void request_ahead(int j, int64_t at) const {
    if (ahead != nullptr) __builtin_prefetch(base + ahead[j] + at, 0, 3);
  }
};

// Keys whose K/V rows are requested ahead of the compute, into L2. With AVX-512, decodes
// over a 64 x 250 batch ran 25-30% faster than with 32 keys into L1, and 64-512 keys all
// did about as well (benchmarks/attention_cpu.py); on an AVX2 machine (Zen 3), 0 to 256
// keys ran within its noise of each other.
constexpr int64_t kPrefetchKeys = 128;
// Keys whose rows are also requested into L1, half a chunk ahead, for items of at most
// kNearPrefetchRows query rows (decodes: few query vectors per key, so the memory's speed is
// theirs). On a Zen 5 VM (AVX-512 BF16) the L2 requests alone left decodes at 8 GB/s a
// core: with these beside them, 16 x 230 and 64 x 230 decodes ran 10-15% faster, and 16 to
// 128 keys did about as well. Prefill items, which reuse each key for many rows, ran 5-10%
// slower with them. Decode items now also request each line a chunk ahead as they read
// (attention_item.h); beside those, these still took 7% off 64 x 280 decodes (0.59 ->
// 0.55 ms a layer on the same VM).
constexpr int64_t kNearPrefetchKeys = 16;
constexpr int64_t kNearPrefetchRows = 4;

// Requests the K/V rows of the keys `distance` ahead of the compute (none at 0), into the
// cache level `Hint` (__builtin_prefetch's locality: 3 is L1, 2 is L2): the pages are known
// in advance but scattered, which the hardware prefetchers cannot guess.
template <typename T, int Hint>
struct Prefetcher {
  const T* k_cache;
  const T* v_cache;
  PageCursor cursor;
  int64_t num_keys, row_bytes, issued;  // issued: keys requested so far, from the first
  int64_t distance;

  void advance_to(int64_t key) {  // key: the first key whose compute has not started
    if (distance <= 0) return;
    const int64_t stop = std::min(num_keys, key + distance);
    int64_t rows[kChunk];
    while (issued < stop) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, stop - issued));
      cursor.next_rows(n, rows);
      for (int j = 0; j < n; ++j) {
        const char* k = reinterpret_cast<const char*>(k_cache + rows[j]);
        const char* v = reinterpret_cast<const char*>(v_cache + rows[j]);
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(k + b, 0, Hint);
          __builtin_prefetch(v + b, 0, Hint);
        }
      }
      issued += n;
    }
  }
};

// The keys begin..end that a work item walks (see WorkItem).
struct ItemKeys {
  int64_t begin, end;
  bool shared;  // a shared-prefix item: every row sees every key
  bool save;    // the item saves its states (a shared-prefix item or a part) for later
};

// The first key that query row i (of a request with `computed` cached keys) sees: 0, or
// with a sliding window of `window` keys, the window's first.
inline int64_t first_visible_key(int64_t computed, int64_t i, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, computed + i + 1 - window) : 0;
}

// The key from which a walk over the keys of rows row_begin.. must start, at the start of a
// page and a chunk (chunk_aligned_keys): the keys before it lie outside every such row's
// window (with no window, key 0). Rows in different items (a prompt's tiles, or its chunks
// over several steps) so walk their keys in the same chunks.
inline int64_t first_walked_key(int64_t computed, int64_t row_begin, int64_t window,
                                int64_t block_size) {
  const int64_t first = first_visible_key(computed, row_begin, window);
  return first - first % chunk_aligned_keys(block_size);
}

template <typename T>
ItemKeys keys_of(const Problem<T>& pb, const Span& sp, const WorkItem& it) {
  if (it.shared_keys > 0) return {0, it.shared_keys, true, true};
  if (it.part >= 0) return {it.key_begin, it.key_end, false, true};
  // Shared prefixes are never planned with a window (find_shared_prefixes), so an item
  // that starts past key 0 only ever does so for its window.
  const int64_t begin = std::max<int64_t>(
      it.key_begin, first_walked_key(sp.computed, it.row_begin, pb.window, pb.block_size));
  return {begin, sp.computed + it.row_end, false, false};
}

// The rows of item it's first chunk of keys, for KV head it.kv_head, padded to kChunk with
// the last; false if the item walks no keys.
template <typename T>
bool first_chunk_rows(const Problem<T>& pb, const WorkItem& it, int64_t* rows) {
  const Span sp = span_of(pb, it.req);
  const ItemKeys keys = keys_of(pb, sp, it);
  const int n = static_cast<int>(std::min<int64_t>(kChunk, keys.end - keys.begin));
  if (n <= 0) return false;
  cursor_for(pb, sp, it.kv_head, keys.begin).next_rows(n, rows);
  std::fill(rows + n, rows + kChunk, rows[n - 1]);
  return true;
}

// Keys that query row i (of a request with `computed` cached keys) sees in the chunk
// starting at key c holding n keys: at most n, none when the chunk lies in its future.
inline int visible_keys(int64_t computed, int64_t i, int64_t c, int n) {
  return static_cast<int>(std::clamp<int64_t>(computed + i + 1 - c, 0, n));
}

inline int visible_keys(const ItemKeys& keys, int64_t computed, int64_t i, int64_t c, int n) {
  return keys.shared ? n : visible_keys(computed, i, c, n);
}

// Keys of that chunk before row i's sliding window (0 without one): the row sees the
// chunk's keys from this one up to visible_keys.
inline int keys_before_window(int64_t window, int64_t computed, int64_t i, int64_t c, int n) {
  return static_cast<int>(
      std::clamp<int64_t>(first_visible_key(computed, i, window) - c, 0, n));
}

// The saved online-softmax state of row i (from the span's first row) and one head.
template <typename T>
float* saved_state(const Problem<T>& pb, const Span& sp, int64_t i, int64_t head) {
  const int64_t num_heads = pb.num_kv_heads * pb.group;
  return pb.state + ((sp.q_begin + i) * num_heads + head) * (pb.head_dim + 2);
}

// Where a part of a split decode leaves its state for one head (attention_ops.cpp merges).
template <typename T>
float* part_state(const Problem<T>& pb, int64_t split, int64_t head, int64_t part) {
  const int64_t num_heads = pb.num_kv_heads * pb.group;
  return pb.parts + ((split * num_heads + head) * kMaxParts + part) * (pb.head_dim + 2);
}

// Starts the item's M query vectors of KV head kv_head (m = row * group + head in group),
// in scratch from vector `first` on: fresh, or where a shared-prefix item left them.
template <typename T>
void start_states(const Problem<T>& pb, const WorkItem& it, const Span& sp, int64_t M,
                  Scratch& s, int64_t kv_head, int64_t first = 0) {
  const int64_t D = pb.head_dim, G = pb.group;
  if (it.key_begin == 0 || it.part >= 0) {
    std::fill_n(s.acc.begin() + first * D, M * D, 0.0f);
    std::fill_n(s.row_max.begin() + first, M, kNegInf);
    std::fill_n(s.row_sum.begin() + first, M, 0.0f);
    return;
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* st = saved_state(pb, sp, it.row_begin + m / G, kv_head * G + m % G);
    std::copy_n(st, D, &s.acc[(first + m) * D]);
    s.row_max[first + m] = st[D];
    s.row_sum[first + m] = st[D + 1];
  }
}

// What a shared-prefix item leaves for the items that go on from its last key, or a part
// for the merge (the M vectors of KV head kv_head, in scratch from vector `first` on).
template <typename T>
void save_states(const Problem<T>& pb, const WorkItem& it, const Span& sp, int64_t M,
                 const Scratch& s, int64_t kv_head, int64_t first = 0) {
  const int64_t D = pb.head_dim, G = pb.group;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = it.row_begin + m / G, head = kv_head * G + m % G;
    float* st = it.part >= 0 ? part_state(pb, it.split, head, it.part)
                             : saved_state(pb, sp, i, head);
    std::copy_n(&s.acc[(first + m) * D], D, st);
    st[D] = s.row_max[first + m];
    st[D + 1] = s.row_sum[first + m];
  }
}

// The softmax denominator of an online-softmax state of `head` whose running max and sum
// are mx and sum: the sum, plus exp(sink - mx) with attention sinks.
template <typename T>
float denominator(const Problem<T>& pb, int64_t head, float mx, float sum) {
  return pb.sinks != nullptr ? sum + std::exp(pb.sinks[head] - mx) : sum;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

}  // namespace pagedserve::PAGEDSERVE_ISA
