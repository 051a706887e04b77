// The paged-attention work item (attention_ops.cpp plans the items and says what they
// compute), written once for every instruction set over a struct of vector primitives V:
//
//   V::F, V::W            a vector of W float32 lanes (W divides kChunk = 32)
//   kAccRegs              accumulator registers a value block may hold
//   kKeysOuter            score a chunk key by key (q in registers), not d by d
//   zero, set1, add, sub, mul, fmadd(a, b, c) = a * b + c
//   load(p), store(p, v)  W values of float32, bfloat16 or float16 as float32 lanes (store
//                         rounds to nearest even, as c10 does)
//   exp(x)                for x <= 0, the Cephes polynomial (inputs below -87 give ~1e-38)
//   keep_first(x, cnt)    lanes below cnt (any int) kept, the others 0
//   low_first(x, cnt)     lanes below cnt kept, the others -inf
//   max(a, b), reduce_max(x), reduce_add(x)   lane-wise max; the lanes' max and sum (the
//                         sum in a fixed order)
//   transpose_sum(v[W])   lane j = reduce_add-like sum of v[j]
//   kBf16Dot,             where the set has a bf16 dot product (AVX512_BF16): a chunk's
//   transpose_pairs,      bf16 keys transposed once a head to keys as lanes, the scores of
//   dot_pairs,            a block of query vectors against them, and p.V with p rounded
//   accumulate_bf16       to bf16; nothing widened, acc in natural lane order
//
// simd_portable.h (VecGeneric, VecScalar), simd_avx2.h (Vec256) and simd_avx512.h
// (Vec512, Vec512Bf16) define them; attention_kernels.cpp picks one per set and head size.
// Nothing below knows which.
//
// An item may take several KV heads (a decode's, in a batch of many): each chunk's rows of
// all its heads are then read together, as they lie side by side in the cache. A chunk's
// keys are widened to float32 once, into scratch, for all query vectors of each head,
// unless they can be read where they lie (float32 rows of a one-head item, or bf16 rows
// with the bf16 dot product). Each query vector's scores of W keys are W vectors of
// partial sums over head_dim, then one transposing sum; with the bf16 dot product, a
// chunk's keys are transposed into scratch instead (keys as lanes, pairs of elements as
// rows), which serves every query vector of the head. Values are read in slices of SV
// vectors, each multiplied into the accumulators of MB query vectors held in registers.
// Every query vector's arithmetic is the same whatever else is in its item (register block,
// other heads, other rows), so a request gives the same result alone, in a batch, or after
// a shared-prefix item.
//
// A decode item reads each key once for a few query vectors, so its speed is the memory's:
// as it reads a line of a chunk's keys or values, it requests the same line of the next
// chunk's (ChunkRows::request_ahead), and its last chunk requests the first of the item its
// thread runs next (Scratch::next). Requested so, one line per line read, the lines of the
// next chunk arrive while this one is computed; the same requests issued all at once at
// the start of each chunk (into_l1 below, alone) left the item waiting on them. On a Zen 5
// VM (AVX-512 BF16, 2 threads), 64 decodes of ~280 keys went from 0.89 to 0.57 ms a layer
// (benchmarks/attention_cpu.py --layers 30), about a third less for 1 to 64 decodes of 230
// to 2000 keys, and each other set's kernel gained too.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "attention_common.h"

namespace pagedserve::PAGEDSERVE_ISA {

// Lane j: q . k[j] over `vecs` vectors of W float32 (DV > 0: vecs is DV, known at compile
// time). Each key's sum runs over d in order either way. With V::kKeysOuter, q is held in
// registers and the keys are taken one at a time (few row addresses live at once: 16 of
// them do not fit the general registers); otherwise each q vector serves all W keys.
template <class V, int DV>
PAGEDSERVE_INLINE typename V::F dot_keys(const float* q, const ChunkRows<float>& k,
                                         int64_t vecs) {
  using F = typename V::F;
  F acc[V::W];
  if constexpr (V::kKeysOuter && DV > 0 && DV <= V::kAccRegs) {
    F qv[DV];
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) qv[d] = V::load(q + V::W * d);
#pragma GCC unroll 16
    for (int j = 0; j < V::W; ++j) {
      const float* row = k[j];
      F sum = V::mul(qv[0], V::load(row));
#pragma GCC unroll 16
      for (int d = 1; d < DV; ++d) sum = V::fmadd(qv[d], V::load(row + V::W * d), sum);
      acc[j] = sum;
    }
  } else {
    const int64_t nv = DV > 0 ? DV : vecs;
    const F q0 = V::load(q);
#pragma GCC unroll 16
    for (int j = 0; j < V::W; ++j) acc[j] = V::mul(q0, V::load(k[j]));
    for (int64_t d = 1; d < nv; ++d) {
      const F qd = V::load(q + V::W * d);
#pragma GCC unroll 16
      for (int j = 0; j < V::W; ++j) acc[j] = V::fmadd(qd, V::load(k[j] + V::W * d), acc[j]);
    }
  }
  return V::transpose_sum(acc);
}

// acc[mm] = acc[mm] * alpha[mm] + sum_j p[mm][j] * v[j] over the SV vectors at d0, for MB
// query vectors whose accumulators stay in registers while the keys stream by. float32
// values are read by the multiply-adds themselves; 16-bit ones are widened once per key.
template <class V, int MB, int SV, typename S>
PAGEDSERVE_INLINE void accumulate_slice(float* acc, int64_t D, int64_t d0, const float* p,
                             const float* alpha, const ChunkRows<S>& v, int n) {
  using F = typename V::F;
  F a[MB][SV];
#pragma GCC unroll 16
  for (int mm = 0; mm < MB; ++mm) {
    const F al = V::set1(alpha[mm]);
#pragma GCC unroll 16
    for (int x = 0; x < SV; ++x) a[mm][x] = V::mul(V::load(acc + mm * D + d0 + V::W * x), al);
  }
  for (int j = 0; j < n; ++j) {
    const S* row = v[j] + d0;
#pragma GCC unroll 16
    for (int x = 0; x < SV; ++x) {
      if (V::W * x % kLineElements<S> == 0) v.request_ahead(j, d0 + V::W * x);
    }
    if constexpr (std::is_same_v<S, float>) {
#pragma GCC unroll 16
      for (int mm = 0; mm < MB; ++mm) {
        const F pj = V::set1(p[mm * kChunk + j]);
#pragma GCC unroll 16
        for (int x = 0; x < SV; ++x) a[mm][x] = V::fmadd(pj, V::load(row + V::W * x), a[mm][x]);
      }
    } else {
      F wide[SV];
#pragma GCC unroll 16
      for (int x = 0; x < SV; ++x) wide[x] = V::load(row + V::W * x);
#pragma GCC unroll 16
      for (int mm = 0; mm < MB; ++mm) {
        const F pj = V::set1(p[mm * kChunk + j]);
#pragma GCC unroll 16
        for (int x = 0; x < SV; ++x) a[mm][x] = V::fmadd(pj, wide[x], a[mm][x]);
      }
    }
  }
#pragma GCC unroll 16
  for (int mm = 0; mm < MB; ++mm) {
#pragma GCC unroll 16
    for (int x = 0; x < SV; ++x) V::store(acc + mm * D + d0 + V::W * x, a[mm][x]);
  }
}

// Calls f(std::integral_constant<int, mb>{}, m) over query vectors begin..end in register
// blocks of MB (at most 4), the last one smaller.
template <int MB, typename Fn>
inline void for_register_blocks(int64_t begin, int64_t end, Fn&& f) {
  static_assert(MB >= 1 && MB <= 4);
  for (int64_t m = begin; m < end; m += MB) {
    switch (std::min<int64_t>(MB, end - m)) {
      case 4:
        if constexpr (MB >= 4) f(std::integral_constant<int, 4>{}, m);
        break;
      case 3:
        if constexpr (MB >= 3) f(std::integral_constant<int, 3>{}, m);
        break;
      case 2:
        if constexpr (MB >= 2) f(std::integral_constant<int, 2>{}, m);
        break;
      default: f(std::integral_constant<int, 1>{}, m); break;
    }
  }
}

// One work item: for each of its KV heads, query vectors m = (row, head in group),
// 0 <= m < M, against that head's keys, kChunk keys per step. Head hl (from the item's
// first) keeps its vectors' states in scratch from vector hl * M on, and its widened chunk
// of keys and values at hl * kChunk rows. head_dim = W * DV (DV = 0: known at run time).
// Subtracted from the scores of keys before a row's sliding window: finite (so no inf - inf
// can make a NaN), and far below any score a row sees.
constexpr float kFarBelow = 1e30f;

template <class V, typename T, int DV>
class AttentionItem {
  using F = typename V::F;
  static constexpr int W = V::W;
  static constexpr int kGroups = kChunk / W;  // score vectors per chunk
  static_assert(kChunk % W == 0);
  static constexpr bool kFloat = std::is_same_v<T, float>;
  static constexpr bool kDotBf16 = V::kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  using K = float;  // keys as scored by dot_keys (bf16 ones go through dot_pairs)
  // bf16 values through the dot product, in slices of NB blocks of 32 values.
  static constexpr bool kDotValues = kDotBf16 && DV > 0 && DV % 2 == 0;
  static constexpr int NB = DV % 4 == 0 ? 2 : 1;
  static constexpr int kBlockBf16 = std::clamp(V::kAccRegs / (2 * NB), 1, 4);
  // Value slices of SV vectors, in register blocks of MB query vectors (one fewer where
  // 16-bit values need registers to be widened into).
  static constexpr int SV = DV > 0 && DV % 4 == 0 ? 4 : DV > 0 && DV % 2 == 0 ? 2 : 1;
  static constexpr int kBlockFloat = std::clamp(V::kAccRegs / SV, 1, 4);
  static constexpr int kBlockWide = std::clamp(V::kAccRegs / SV - 1, 1, 4);
  // Query vectors scored together against a chunk's transposed keys: each key load serves
  // all of them (4 x kGroups x 2 accumulators).
  static constexpr int kScoreBlock = kDotBf16 ? 4 : 1;

 public:
  AttentionItem(const Problem<T>& pb, const WorkItem& it, Scratch& s)
      : pb_(pb), it_(it), s_(s), sp_(span_of(pb, it.req)), keys_(keys_of(pb, sp_, it)),
        D_(pb.head_dim), NV_(DV > 0 ? DV : pb.head_dim / W),
        M_((it.row_end - it.row_begin) * pb.group), H_(it.kv_heads),
        // One head's float32 rows are read where they lie; anything else is widened, and
        // several heads' rows are copied out together, in the order they lie in memory
        // (a 64-decode batch ran in half the time of one head per item on AVX2).
        raw_keys_(kDotBf16 || (kFloat && it.kv_heads == 1)) {}

  void run() {
    for (int64_t hl = 0; hl < H_; ++hl) {
      load_queries(hl);
      start_states(pb_, it_, sp_, M_, s_, it_.kv_head + hl, hl * M_);
    }
    PageCursor cursor = cursor_for(pb_, sp_, it_.kv_head, keys_.begin);
    const int64_t row_bytes = H_ * D_ * static_cast<int64_t>(sizeof(T));
    Prefetcher<T, 2> into_l2{pb_.k_cache, pb_.v_cache, cursor, keys_.end,
                             row_bytes, keys_.begin, kPrefetchKeys};
    const bool decode = it_.row_end - it_.row_begin <= kNearPrefetchRows;
    Prefetcher<T, 3> into_l1{pb_.k_cache, pb_.v_cache, cursor, keys_.end,
                             row_bytes, keys_.begin, decode ? kNearPrefetchKeys : 0};
    into_l2.advance_to(keys_.begin);
    into_l1.advance_to(keys_.begin);
    // This chunk's rows, and the next chunk's (past the last, the next item's first).
    int64_t buffers[2][kChunk];
    int64_t* rows = buffers[0];
    int64_t* next_rows = buffers[1];
    int n = static_cast<int>(std::min<int64_t>(kChunk, keys_.end - keys_.begin));
    if (n > 0) cursor.next_rows(n, rows);
    for (int64_t c = keys_.begin; c < keys_.end; c += kChunk) {
      const int n_next = static_cast<int>(std::clamp<int64_t>(keys_.end - c - n, 0, kChunk));
      const int64_t* ahead = nullptr;
      if (n_next > 0) {
        cursor.next_rows(n_next, next_rows);
        std::fill(next_rows + n_next, next_rows + kChunk, next_rows[n_next - 1]);
        if (decode) ahead = next_rows;
      } else if (decode && s_.next != nullptr &&
                 first_chunk_rows(pb_, *s_.next, next_rows)) {
        ahead = next_rows;
      }
      into_l2.advance_to(c + n);
      into_l1.advance_to(c + n);
      if (!raw_keys_) widen_rows(pb_.k_cache, rows, ahead, n, s_.k.data());
      for (int64_t hl = 0; hl < H_; ++hl) {
        if (raw_keys_) {
          softmax_chunk<true>(hl, rows, ahead, c, n);
        } else {
          softmax_chunk<false>(hl, rows, ahead, c, n);
        }
      }
      accumulate_chunk(rows, ahead, n);
      std::swap(rows, next_rows);
      n = n_next;
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
  const T* query(int64_t hl, int64_t m) const {
    return pb_.q + (sp_.q_begin + row_of(m)) * pb_.q_stride + head_of(hl, m) * D_;
  }

  // Head hl's query vectors as float32, unless the bf16 dot product reads them in place.
  void load_queries(int64_t hl) {
    if constexpr (kDotBf16) return;
    for (int64_t m = 0; m < M_; ++m) {
      const T* src = query(hl, m);
      float* dst = &s_.q[(hl * M_ + m) * D_];
#pragma GCC unroll 16
      for (int64_t d = 0; d < vecs(); ++d) V::store(dst + W * d, V::load(src + W * d));
    }
  }

  // Vectors per row, and elements between rows of a widened chunk: constants where
  // head_dim is.
  int64_t vecs() const { return DV > 0 ? DV : NV_; }
  int64_t stride() const { return DV > 0 ? W * DV : D_; }

  // Head hl's keys of the chunk from key j0 on: in the cache at raw_rows, or widened.
  template <bool kRaw>
  ChunkRows<K> chunk_keys(int64_t hl, const int64_t* raw_rows, int j0) const {
    if constexpr (kRaw) {
      return {reinterpret_cast<const K*>(pb_.k_cache) + hl * D_, raw_rows + j0, 0};
    } else {
      const float* widened = s_.k.data() + (hl * kChunk + j0) * stride();
      return {reinterpret_cast<const K*>(widened), nullptr, stride()};
    }
  }

  // Lane j: query vector m of head hl against key row k[j].
  F scores(int64_t hl, int64_t m, const ChunkRows<K>& k) const {
    return dot_keys<V, DV>(&s_.q[(hl * M_ + m) * D_], k, NV_);
  }

  // Scores of head hl's query vectors against the chunk's keys; updates the running max
  // and sum, leaving p and the accumulator rescale alpha per vector.
  template <bool kRaw>
  void softmax_chunk(int64_t hl, const int64_t* rows, const int64_t* ahead, int64_t c, int n) {
    // The keys past n are scored, then masked out: key 0's row again, or whatever the
    // scratch holds (zeros, or an earlier chunk's keys).
    int64_t raw_rows[kChunk];
    std::copy_n(rows, n, raw_rows);
    std::fill(raw_rows + n, raw_rows + kChunk, raw_rows[0]);
    if constexpr (kDotBf16) {
      V::transpose_pairs(ChunkRows<c10::BFloat16>{pb_.k_cache + hl * D_, raw_rows, 0, ahead},
                         D_ / 2, transposed_keys());
    }
    for_register_blocks<kScoreBlock>(hl * M_, (hl + 1) * M_, [&](auto mb, int64_t m) {
      softmax_vectors<kRaw, decltype(mb)::value>(hl, raw_rows, c, n, m);
    });
  }

  int32_t* transposed_keys() const { return reinterpret_cast<int32_t*>(s_.kt.data()); }

  // softmax_chunk for query vectors m0..m0 + MS: their scores, then their updates.
  template <bool kRaw, int MS>
  PAGEDSERVE_INLINE void softmax_vectors(int64_t hl, const int64_t* raw_rows, int64_t c, int n,
                                         int64_t m0) {
    const F scale = V::set1(pb_.scale);
    int visible[MS], past[MS];
#pragma GCC unroll 4
    for (int i = 0; i < MS; ++i) {
      const int64_t row = row_of(m0 + i - hl * M_);
      visible[i] = visible_keys(keys_, sp_.computed, row, c, n);
      // The row sees keys before..cnt of the chunk; before > 0 only with a sliding window.
      past[i] = keys_.shared ? 0 : keys_before_window(pb_.window, sp_.computed, row, c, n);
    }
    F sc[MS][kGroups];
    if constexpr (kDotBf16) {
      const c10::BFloat16* q[MS];
#pragma GCC unroll 4
      for (int i = 0; i < MS; ++i) q[i] = query(hl, m0 + i - hl * M_);
      V::template dot_pairs<MS, kGroups>(q, transposed_keys(), D_ / 2, sc);
    } else {
#pragma GCC unroll 4
      for (int i = 0; i < MS; ++i) {
        if (visible[i] <= past[i]) continue;
#pragma GCC unroll 16
        for (int g = 0; g < kGroups; ++g) {
          sc[i][g] = scores(hl, m0 + i - hl * M_, chunk_keys<kRaw>(hl, raw_rows, g * W));
        }
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MS; ++i) {
      const int64_t m = m0 + i;
      const int cnt = visible[i], before = past[i];
      F p[kGroups];
#pragma GCC unroll 16
      for (int g = 0; g < kGroups; ++g) p[g] = V::zero();
      s_.alpha[m] = 1.0f;
      if (cnt > before) {  // else the whole chunk is in this row's future or past
        F highest = V::set1(kNegInf);
#pragma GCC unroll 16
        for (int g = 0; g < kGroups; ++g) {
          sc[i][g] = V::mul(sc[i][g], scale);
          // Scores before the window are pushed far below any the row sees, which leaves
          // the max to those (the chunk has one), and their exp to 0 after the mask below.
          if (before > 0) {
            sc[i][g] = V::sub(sc[i][g], V::keep_first(V::set1(kFarBelow), before - g * W));
          }
          highest = V::max(highest, V::low_first(sc[i][g], cnt - g * W));
        }
        const float mx = std::max(s_.row_max[m], V::reduce_max(highest));
        F total = V::zero();
#pragma GCC unroll 16
        for (int g = 0; g < kGroups; ++g) {
          p[g] = V::keep_first(V::exp(V::sub(sc[i][g], V::set1(mx))), cnt - g * W);
          if (before > 0) p[g] = V::sub(p[g], V::keep_first(p[g], before - g * W));
          total = V::add(total, p[g]);
        }
        if (mx != s_.row_max[m]) s_.alpha[m] = std::exp(s_.row_max[m] - mx);
        s_.row_sum[m] = s_.row_sum[m] * s_.alpha[m] + V::reduce_add(total);
        s_.row_max[m] = mx;
      }
#pragma GCC unroll 16
      for (int g = 0; g < kGroups; ++g) V::store(&s_.p[m * kChunk + g * W], p[g]);
      if constexpr (kDotValues) {
        auto* p16 = reinterpret_cast<c10::BFloat16*>(s_.p16.data());
#pragma GCC unroll 16
        for (int g = 0; g < kGroups; ++g) V::store(p16 + m * kChunk + g * W, p[g]);
      }
    }
  }

  // acc = acc * alpha + p.V over the chunk's values, slice by slice, in register blocks.
  void accumulate_chunk(const int64_t* rows, const int64_t* ahead, int n) {
    if constexpr (kDotValues) {
      for (int64_t hl = 0; hl < H_; ++hl) {
        accumulate_bf16_blocks(
            hl, ChunkRows<c10::BFloat16>{pb_.v_cache + hl * D_, rows, 0, ahead}, n);
      }
      return;
    }
    // Values widened once serve every register block; with one block of one head,
    // widening on the fly reads each value once anyway.
    if (H_ == 1 && (kFloat || M_ <= kBlockWide)) {
      for (int64_t hl = 0; hl < H_; ++hl) {
        accumulate_blocks<T>(hl, ChunkRows<T>{pb_.v_cache + hl * D_, rows, 0, ahead}, n);
      }
      return;
    }
    widen_rows(pb_.v_cache, rows, ahead, n, s_.v.data());
    for (int64_t hl = 0; hl < H_; ++hl) {
      const float* widened = s_.v.data() + hl * kChunk * stride();
      accumulate_blocks<float>(hl, ChunkRows<float>{widened, nullptr, stride()}, n);
    }
  }

  template <typename S>
  void accumulate_blocks(int64_t hl, const ChunkRows<S>& v, int n) {
    constexpr int MB = std::is_same_v<S, float> ? kBlockFloat : kBlockWide;
    for_register_blocks<MB>(hl * M_, (hl + 1) * M_, [&](auto mb, int64_t m) {
      for (int64_t d0 = 0; d0 < D_; d0 += W * SV) {
        accumulate_slice<V, decltype(mb)::value, SV>(&s_.acc[m * D_], D_, d0,
                                                      &s_.p[m * kChunk], &s_.alpha[m], v, n);
      }
    });
  }

  void accumulate_bf16_blocks(int64_t hl, const ChunkRows<c10::BFloat16>& v, int n) {
    if constexpr (kDotValues) {
      const auto* p16 = reinterpret_cast<const c10::BFloat16*>(s_.p16.data());
      for_register_blocks<kBlockBf16>(hl * M_, (hl + 1) * M_, [&](auto mb, int64_t m) {
        for (int64_t d0 = 0; d0 < D_; d0 += 32 * NB) {
          V::template accumulate_bf16<decltype(mb)::value, NB>(
              &s_.acc[m * D_], D_, d0, p16 + m * kChunk, &s_.alpha[m], v, n);
        }
      });
    }
  }

  // The chunk's rows of every head of the item, as float32: head hl's row j at
  // (hl * kChunk + j) * D. They are read in memory order, each key's heads side by side.
  void widen_rows(const T* base, const int64_t* rows, const int64_t* ahead, int n,
                  float* dst) const {
    const ChunkRows<T> chunk{base, rows, 0, ahead};
    for (int j = 0; j < n; ++j) {
      for (int64_t hl = 0; hl < H_; ++hl) {
        const T* src = chunk[j] + hl * D_;
        float* out = dst + (hl * kChunk + j) * stride();
#pragma GCC unroll 16
        for (int64_t d = 0; d < vecs(); ++d) {
          if (W * d % kLineElements<T> == 0) chunk.request_ahead(j, hl * D_ + W * d);
          V::store(out + W * d, V::load(src + W * d));
        }
      }
    }
  }

  void write_outputs(int64_t hl) {
    for (int64_t m = 0; m < M_; ++m) {
      T* dst = pb_.out + (sp_.q_begin + row_of(m)) * pb_.out_stride + head_of(hl, m) * D_;
      const int64_t v = hl * M_ + m;
      const float sum = denominator(pb_, head_of(hl, m), s_.row_max[v], s_.row_sum[v]);
      const F inv = V::set1(1.0f / sum);
      const float* acc = &s_.acc[(hl * M_ + m) * D_];
#pragma GCC unroll 16
      for (int64_t d = 0; d < vecs(); ++d) {
        V::store(dst + W * d, V::mul(V::load(acc + W * d), inv));
      }
    }
  }

  const Problem<T>& pb_;
  const WorkItem& it_;
  Scratch& s_;
  const Span sp_;
  const ItemKeys keys_;
  const int64_t D_, NV_, M_, H_;
  const bool raw_keys_;
};

template <class V, typename T, int DV>
void run_attention_item(const Problem<T>& pb, const WorkItem& it, Scratch& s) {
  AttentionItem<V, T, DV>(pb, it, s).run();
}

}  // namespace pagedserve::PAGEDSERVE_ISA
