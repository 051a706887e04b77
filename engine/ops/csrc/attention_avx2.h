// The AVX2 paged-attention item kernel: attention_avx512.h's algorithm in 8-lane vectors,
// for head_dim = 8 * DV with DV even. The 16 keys of a chunk are two vectors of 8 scores.
//
// An item may take several KV heads (a decode's, in a batch of many): each chunk's rows of
// all its heads are then read together, as they lie side by side in the cache, which ran a
// 64-decode batch in half the time of one head per item. A chunk's keys are widened to
// float32 once, into scratch, for all M query vectors of each head (the float32 keys of a
// one-head item are read where they lie). Each query vector's scores of 8 keys are 8
// vectors of partial sums (one per key, over head_dim in steps of 8), then one transposing
// sum. The values are read in slices of a few vectors, each multiplied into
// the accumulators of a few query vectors held in registers (ValueBlocks). Every query
// vector's arithmetic is the same whatever else is in its item, so a request gives the same
// result alone, in a batch, or after a shared-prefix item.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention_common.h"
#include "simd_avx2.h"

namespace pagedserve::PAGEDSERVE_ISA::avx2 {

// Lane j of the result is the horizontal sum of v[j].
inline __m256 transpose_sum8(const __m256 (&v)[8]) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  // [v0 v1 v2 v3 lanes 0-3 | the same, lanes 4-7], then v4..v7 likewise
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Lane j: q . k_j over 8 * DV float32 elements, for 8 keys whose rows are `rows`
// (element offsets from base), or, without rows, base + j * 8 * DV: the widened chunk, whose
// fixed stride the addressing takes for free.
template <int DV>
inline __m256 dot8(const float* q, const float* base, const int64_t* rows) {
  const float* k[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) k[j] = rows != nullptr ? base + rows[j] : base + j * 8 * DV;
  __m256 acc[8];
  const __m256 q0 = _mm256_loadu_ps(q);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[j]));
  for (int d = 1; d < DV; ++d) {
    const __m256 qd = _mm256_loadu_ps(q + 8 * d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[j] + 8 * d), acc[j]);
  }
  return transpose_sum8(acc);
}

// Lanes below cnt (0..8) all ones, the others zero.
inline __m256 first_lanes(int cnt) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), lane));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// acc[mm] = acc[mm] * alpha[mm] + sum_j p[mm][j] * V[j] over the SV vectors of a slice at
// d0, for MB query vectors whose accumulators stay in registers while the keys stream by.
// Value row j is `rows[j]` elements from base, or, without rows, j * D (the widened chunk).
// float32 values are read by the FMAs themselves; 16-bit ones are widened once per key.
template <int MB, int SV, typename S>
inline void accumulate_slice(float* acc, int64_t D, int64_t d0, const float* p,
                             const float* alpha, const S* base, const int64_t* rows, int n) {
  __m256 a[MB][SV];
#pragma GCC unroll 4
  for (int mm = 0; mm < MB; ++mm) {
    const __m256 al = _mm256_set1_ps(alpha[mm]);
#pragma GCC unroll 4
    for (int x = 0; x < SV; ++x) {
      a[mm][x] = _mm256_mul_ps(_mm256_loadu_ps(acc + mm * D + d0 + 8 * x), al);
    }
  }
  for (int j = 0; j < n; ++j) {
    const S* v = (rows != nullptr ? base + rows[j] : base + j * D) + d0;
    if constexpr (std::is_same_v<S, float>) {
#pragma GCC unroll 4
      for (int mm = 0; mm < MB; ++mm) {
        const __m256 pj = _mm256_broadcast_ss(p + mm * kChunk + j);
#pragma GCC unroll 4
        for (int x = 0; x < SV; ++x) {
          a[mm][x] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * x), a[mm][x]);
        }
      }
    } else {
      __m256 row[SV];
#pragma GCC unroll 4
      for (int x = 0; x < SV; ++x) row[x] = load8(v + 8 * x);
#pragma GCC unroll 4
      for (int mm = 0; mm < MB; ++mm) {
        const __m256 pj = _mm256_broadcast_ss(p + mm * kChunk + j);
#pragma GCC unroll 4
        for (int x = 0; x < SV; ++x) a[mm][x] = _mm256_fmadd_ps(pj, row[x], a[mm][x]);
      }
    }
  }
#pragma GCC unroll 4
  for (int mm = 0; mm < MB; ++mm) {
#pragma GCC unroll 4
    for (int x = 0; x < SV; ++x) _mm256_storeu_ps(acc + mm * D + d0 + 8 * x, a[mm][x]);
  }
}

// Register blocks for accumulate_slice: with float32 values, 3 query vectors x 4 vectors
// of accumulators (12 registers and a broadcast); widening 16-bit values costs registers
// for the row, so 4 x 2 there.
template <typename S>
struct ValueBlocks {
  static constexpr bool kFloat = std::is_same_v<S, float>;
  static constexpr int kQueries = kFloat ? 3 : 4;
  template <int DV>
  static constexpr int slice() {
    return kFloat && DV % 4 == 0 ? 4 : 2;
  }
};

// One work item: for each of its KV heads, query vectors m = (row, head in group),
// 0 <= m < M, against that head's keys, 16 keys per step. Head hl (from the item's first)
// keeps its vectors' states in scratch from vector hl * M on, and its widened chunk of
// keys and values at hl * kChunk rows.
template <typename T, int DV>
class AttentionItem {
  static_assert(DV % 2 == 0);
  static constexpr int64_t D = 8 * DV;
  static constexpr bool kFloat = std::is_same_v<T, float>;

 public:
  AttentionItem(const Problem<T>& pb, const WorkItem& it, Scratch& s)
      : pb_(pb), it_(it), s_(s), sp_(span_of(pb, it.req)), keys_(keys_of(sp_, it)),
        M_((it.row_end - it.row_begin) * pb.group), H_(it.kv_heads),
        // One head's float32 rows are read where they lie; anything else is widened, and
        // several heads' rows are copied out together, in the order they lie in memory.
        raw_(kFloat && it.kv_heads == 1) {}

  void run() {
    for (int64_t hl = 0; hl < H_; ++hl) {
      load_queries(hl);
      start_states(pb_, it_, sp_, M_, s_, it_.kv_head + hl, hl * M_);
    }
    PageCursor cursor = cursor_for(pb_, sp_, it_.kv_head, keys_.begin);
    Prefetcher<T> prefetcher{pb_.k_cache, pb_.v_cache, cursor, keys_.end,
                             H_ * D * static_cast<int64_t>(sizeof(T)), keys_.begin};
    prefetcher.advance_to(keys_.begin);
    int64_t rows[kChunk];
    for (int64_t c = keys_.begin; c < keys_.end; c += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, keys_.end - c));
      cursor.next_rows(n, rows);
      prefetcher.advance_to(c + n);
      if (!raw_) widen_rows(pb_.k_cache, rows, n, s_.k.data());
      for (int64_t hl = 0; hl < H_; ++hl) softmax_chunk(hl, rows, c, n);
      accumulate_chunk(rows, n);
    }
    for (int64_t hl = 0; hl < H_; ++hl) {
      if (keys_.save) {
        save_states(pb_, it_, sp_, M_, s_, it_.kv_head + hl, hl * M_);
      } else {
        write_outputs(hl);
      }
    }
  }

 private:
  int64_t row_of(int64_t m) const { return it_.row_begin + m / pb_.group; }
  int64_t head_of(int64_t hl, int64_t m) const {
    return (it_.kv_head + hl) * pb_.group + m % pb_.group;
  }

  void load_queries(int64_t hl) {
    for (int64_t m = 0; m < M_; ++m) {
      const T* src = pb_.q + (sp_.q_begin + row_of(m)) * pb_.q_stride + head_of(hl, m) * D;
      float* dst = &s_.q[(hl * M_ + m) * D];
      for (int d = 0; d < DV; ++d) _mm256_storeu_ps(dst + 8 * d, load8(src + 8 * d));
    }
  }

  // Scores of head hl's query vectors against the chunk's keys; updates the running max
  // and sum, leaving p and the accumulator rescale alpha per vector.
  void softmax_chunk(int64_t hl, const int64_t* rows, int64_t c, int n) {
    // The keys past n are scored, then masked out: rows repeated from the cache, or
    // whatever the scratch holds (zeros, or an earlier chunk's keys).
    const float* k_base = s_.k.data() + hl * kChunk * D;
    int64_t raw_rows[kChunk];
    const int64_t* k_rows = nullptr;
    if (raw_) {
      k_base = reinterpret_cast<const float*>(pb_.k_cache);
      std::copy_n(rows, n, raw_rows);
      std::fill(raw_rows + n, raw_rows + kChunk, raw_rows[0]);
      k_rows = raw_rows;
    }
    const __m256 scale = _mm256_set1_ps(pb_.scale);
    for (int64_t m = hl * M_; m < (hl + 1) * M_; ++m) {
      const int cnt = visible_keys(keys_, sp_.computed, row_of(m - hl * M_), c, n);
      __m256 p0 = _mm256_setzero_ps(), p1 = _mm256_setzero_ps();
      s_.alpha[m] = 1.0f;
      if (cnt > 0) {  // else the whole chunk is in this row's future
        const float* q = &s_.q[m * D];
        const __m256 v0 = first_lanes(cnt), v1 = first_lanes(cnt - 8);
        const __m256 low = _mm256_set1_ps(kNegInf);
        const __m256 s0 = _mm256_mul_ps(dot8<DV>(q, k_base, k_rows), scale);
        const __m256 s1 = _mm256_mul_ps(
            raw_ ? dot8<DV>(q, k_base, k_rows + 8) : dot8<DV>(q, k_base + 8 * D, nullptr), scale);
        const float chunk_max =
            hmax8(_mm256_max_ps(_mm256_blendv_ps(low, s0, v0), _mm256_blendv_ps(low, s1, v1)));
        const float mx = std::max(s_.row_max[m], chunk_max);
        const __m256 mxv = _mm256_set1_ps(mx);
        p0 = _mm256_and_ps(v0, exp8(_mm256_sub_ps(s0, mxv)));
        p1 = _mm256_and_ps(v1, exp8(_mm256_sub_ps(s1, mxv)));
        if (mx != s_.row_max[m]) s_.alpha[m] = std::exp(s_.row_max[m] - mx);
        s_.row_sum[m] = s_.row_sum[m] * s_.alpha[m] + hsum8(_mm256_add_ps(p0, p1));
        s_.row_max[m] = mx;
      }
      _mm256_storeu_ps(&s_.p[m * kChunk], p0);
      _mm256_storeu_ps(&s_.p[m * kChunk + 8], p1);
    }
  }

  // acc = acc * alpha + p.V over the chunk's values, slice by slice, in register blocks.
  void accumulate_chunk(const int64_t* rows, int n) {
    // Values widened once serve every register block; with one block of one head,
    // widening on the fly reads each value once anyway.
    if (H_ == 1 && (kFloat || M_ <= ValueBlocks<T>::kQueries)) {
      return accumulate_blocks(0, pb_.v_cache, rows, n);
    }
    widen_rows(pb_.v_cache, rows, n, s_.v.data());
    for (int64_t hl = 0; hl < H_; ++hl) {
      accumulate_blocks(hl, s_.v.data() + hl * kChunk * D, nullptr, n);
    }
  }

  template <typename S>
  void accumulate_blocks(int64_t hl, const S* base, const int64_t* rows, int n) {
    constexpr int MB = ValueBlocks<S>::kQueries, SV = ValueBlocks<S>::template slice<DV>();
    for (int64_t m = hl * M_; m < (hl + 1) * M_; m += MB) {
      float* acc = &s_.acc[m * D];
      const float* p = &s_.p[m * kChunk];
      const float* alpha = &s_.alpha[m];
      const int64_t block = std::min<int64_t>(MB, (hl + 1) * M_ - m);
      for (int64_t d0 = 0; d0 < D; d0 += 8 * SV) {
        auto slice = [&](auto mb) {
          accumulate_slice<decltype(mb)::value, SV>(acc, D, d0, p, alpha, base, rows, n);
        };
        switch (block) {
          case 4:
            if constexpr (MB >= 4) slice(std::integral_constant<int, 4>{});
            break;
          case 3: slice(std::integral_constant<int, 3>{}); break;
          case 2: slice(std::integral_constant<int, 2>{}); break;
          default: slice(std::integral_constant<int, 1>{}); break;
        }
      }
    }
  }

  // The chunk's rows of every head of the item, as float32: head hl's row j at
  // (hl * kChunk + j) * D. They are read in memory order, each key's heads side by side.
  void widen_rows(const T* base, const int64_t* rows, int n, float* dst) const {
    for (int j = 0; j < n; ++j) {
      for (int64_t hl = 0; hl < H_; ++hl) {
        const T* src = base + rows[j] + hl * D;
        float* out = dst + (hl * kChunk + j) * D;
#pragma GCC unroll 32
        for (int d = 0; d < DV; ++d) _mm256_storeu_ps(out + 8 * d, load8(src + 8 * d));
      }
    }
  }

  void write_outputs(int64_t hl) {
    for (int64_t m = 0; m < M_; ++m) {
      T* dst = pb_.out + (sp_.q_begin + row_of(m)) * pb_.out_stride + head_of(hl, m) * D;
      const __m256 inv = _mm256_set1_ps(1.0f / s_.row_sum[hl * M_ + m]);
      const float* acc = &s_.acc[(hl * M_ + m) * D];
      for (int d = 0; d < DV; ++d) {
        store8(dst + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * d), inv));
      }
    }
  }

  const Problem<T>& pb_;
  const WorkItem& it_;
  Scratch& s_;
  const Span sp_;
  const ItemKeys keys_;
  const int64_t M_, H_;
  const bool raw_;
};

template <typename T, int DV>
void attention_item(const Problem<T>& pb, const WorkItem& it, Scratch& s) {
  AttentionItem<T, DV>(pb, it, s).run();
}

}  // namespace pagedserve::PAGEDSERVE_ISA::avx2
