// The AVX-512 paged-attention item kernel. head_dim = 16 * DV, and the scores of 16 keys
// fill one zmm register. With AVX512_BF16, bf16 Q.K^T and P.V use vdpbf16ps (products
// exact in float32, float32 sums); otherwise rows are widened to float32 first.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "attention_common.h"

namespace pagedserve::PAGEDSERVE_ISA::avx512 {

#ifdef __AVX512BF16__
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_f32(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load_f32(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store_f32(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_f32(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store_f32(c10::Half* p, __m512 v) {
  const __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
}

// exp(x) (Cephes polynomial, ~1 ulp): overflows to inf above ~88.7, and inputs below -87
// give ~1e-38 rather than denormals or 0, so exp(-inf - m) is never NaN.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// Lane j of the result is the horizontal sum of v[j].
inline __m512 transpose_sum16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // each 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // each quarter: [a, b, c, d] partial sums
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // quarters 0+1 and 2+3 of both inputs
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// Lane j: q . base[rows[j]], over 16 * DV float32 elements.
template <int DV>
inline __m512 dot16(const float* q, const float* base, const int64_t* rows) {
  __m512 qv[DV], acc[16];
  for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q + 16 * d);
  for (int j = 0; j < 16; ++j) {
    const float* k = base + rows[j];
    __m512 t = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
    for (int d = 1; d < DV; ++d) t = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(k + 16 * d), t);
    acc[j] = t;
  }
  return transpose_sum16(acc);
}

#ifdef __AVX512BF16__
// 32 bf16 values, or 16 zero-extended for the last block of an odd DV.
inline __m512i load_bf16_block(const c10::BFloat16* p, bool half) {
  if (half) return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_si512(p);
}

template <int DV>
inline __m512 dot16(const c10::BFloat16* q, const c10::BFloat16* base, const int64_t* rows) {
  constexpr int NB = (DV + 1) / 2;
  __m512i qv[NB];
  __m512 acc[16];
  for (int b = 0; b < NB; ++b) qv[b] = load_bf16_block(q + 32 * b, 2 * b + 1 == DV);
  for (int j = 0; j < 16; ++j) {
    const c10::BFloat16* k = base + rows[j];
    __m512 t = _mm512_setzero_ps();
    for (int b = 0; b < NB; ++b) {
      const __m512i kb = load_bf16_block(k + 32 * b, 2 * b + 1 == DV);
      t = _mm512_dpbf16_ps(t, (__m512bh)qv[b], (__m512bh)kb);
    }
    acc[j] = t;
  }
  return transpose_sum16(acc);
}

// acc[mm] = acc[mm] * alpha[mm] + sum_j p[mm][j] * V[j] with bf16 p and V, two keys per
// vdpbf16ps. Interleaving rows j and j+1 permutes the accumulator lanes: block b of 32
// values is held as lo (values 0-3, 8-11, 16-19, 24-27) then hi (4-7, 12-15, ...);
// `unpermute_bf16_block` restores the order once, at the end.
template <int NB, int MB>
inline void accumulate_bf16(float* acc, int64_t D, const uint16_t* p16, const float* alpha,
                            const c10::BFloat16* base, const int64_t* rows, int n) {
  __m512 a[MB][2 * NB];
  for (int mm = 0; mm < MB; ++mm) {
    const __m512 al = _mm512_set1_ps(alpha[mm]);
    for (int x = 0; x < 2 * NB; ++x) {
      a[mm][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + mm * D + 16 * x), al);
    }
  }
  for (int j = 0; j < n; j += 2) {
    const c10::BFloat16* r0 = base + rows[j];
    const c10::BFloat16* r1 = j + 1 < n ? base + rows[j + 1] : r0;  // its p is 0
    __m512i lo[NB], hi[NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * b), y = _mm512_loadu_si512(r1 + 32 * b);
      lo[b] = _mm512_unpacklo_epi16(x, y);
      hi[b] = _mm512_unpackhi_epi16(x, y);
    }
    for (int mm = 0; mm < MB; ++mm) {
      int32_t pair;
      std::memcpy(&pair, p16 + mm * kChunk + j, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) {
        a[mm][2 * b] = _mm512_dpbf16_ps(a[mm][2 * b], (__m512bh)lo[b], pp);
        a[mm][2 * b + 1] = _mm512_dpbf16_ps(a[mm][2 * b + 1], (__m512bh)hi[b], pp);
      }
    }
  }
  for (int mm = 0; mm < MB; ++mm) {
    for (int x = 0; x < 2 * NB; ++x) _mm512_storeu_ps(acc + mm * D + 16 * x, a[mm][x]);
  }
}
#endif  // __AVX512BF16__

// Values 0-15 and 16-31 of a block accumulated by accumulate_bf16.
inline void unpermute_bf16_block(const float* acc, __m512& first, __m512& second) {
  const __m512 lo = _mm512_loadu_ps(acc), hi = _mm512_loadu_ps(acc + 16);
  const __m512 t0 = _mm512_shuffle_f32x4(lo, hi, 0x44);  // lo.q0 lo.q1 hi.q0 hi.q1
  const __m512 t1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);  // lo.q2 lo.q3 hi.q2 hi.q3
  first = _mm512_shuffle_f32x4(t0, t0, 0xD8);  // lo.q0 hi.q0 lo.q1 hi.q1
  second = _mm512_shuffle_f32x4(t1, t1, 0xD8);
}

// acc[mm] = acc[mm] * alpha[mm] + sum_j p[mm][j] * V[j] for MB query vectors; the MB * DV
// accumulators stay in registers while each value row is loaded (and widened) once.
template <int DV, int MB, typename S>
inline void accumulate_f32(float* acc, int64_t D, const float* p, const float* alpha,
                           const S* base, const int64_t* rows, int n) {
  __m512 a[MB][DV];
  for (int mm = 0; mm < MB; ++mm) {
    const __m512 al = _mm512_set1_ps(alpha[mm]);
    for (int d = 0; d < DV; ++d) {
      a[mm][d] = _mm512_mul_ps(_mm512_loadu_ps(acc + mm * D + 16 * d), al);
    }
  }
  for (int j = 0; j < n; ++j) {
    __m512 row[DV];
    for (int d = 0; d < DV; ++d) row[d] = load_f32(base + rows[j] + 16 * d);
    for (int mm = 0; mm < MB; ++mm) {
      const __m512 pj = _mm512_set1_ps(p[mm * kChunk + j]);
      for (int d = 0; d < DV; ++d) a[mm][d] = _mm512_fmadd_ps(pj, row[d], a[mm][d]);
    }
  }
  for (int mm = 0; mm < MB; ++mm) {
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(acc + mm * D + 16 * d, a[mm][d]);
  }
}

// Calls block(std::integral_constant<int, mb>, m) over query vectors 0..M in register
// blocks of MB, with the remainder as one smaller block.
template <int MB, typename Block>
inline void for_register_blocks(int64_t M, Block&& block) {
  static_assert(MB >= 1 && MB <= 4);
  int64_t m = 0;
  for (; m + MB <= M; m += MB) block(std::integral_constant<int, MB>{}, m);
  switch (M - m) {
    case 1: block(std::integral_constant<int, 1>{}, m); break;
    case 2: if constexpr (MB > 2) block(std::integral_constant<int, 2>{}, m); break;
    case 3: if constexpr (MB > 3) block(std::integral_constant<int, 3>{}, m); break;
    default: break;
  }
}

// One work item: query vectors m = (row, head in group), 0 <= m < M, against the keys of
// one KV head, 16 keys per step.
template <typename T, int DV>
class AttentionItem {
  static constexpr int64_t D = 16 * DV;
  static constexpr int MB = std::max(1, std::min(4, 16 / DV));  // query vectors per block
  static constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16> && kHaveBf16Dot;
  static constexpr bool kRawKeys = std::is_same_v<T, float> || kBf16;  // else widen to f32
  static constexpr bool kBf16Values = kBf16 && DV % 2 == 0;
  using QK = std::conditional_t<kRawKeys, T, float>;

 public:
  AttentionItem(const Problem<T>& pb, const WorkItem& it, Scratch& s)
      : pb_(pb), it_(it), s_(s), sp_(span_of(pb, it.req)), keys_(keys_of(sp_, it)),
        M_((it.row_end - it.row_begin) * pb.group),
        q_rows_(reinterpret_cast<const QK**>(s.q_rows.data())) {
    for (int j = 0; j < kChunk; ++j) buffer_rows_[j] = j * D;
  }

  void run() {
    load_queries();
    start_states(pb_, it_, sp_, M_, s_, it_.kv_head);
    PageCursor cursor = cursor_for(pb_, sp_, it_.kv_head, keys_.begin);
    Prefetcher<T> prefetcher{pb_.k_cache, pb_.v_cache, cursor, keys_.end,
                             D * static_cast<int64_t>(sizeof(T)), keys_.begin};
    prefetcher.advance_to(keys_.begin);
    int64_t rows[kChunk];
    for (int64_t c = keys_.begin; c < keys_.end; c += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, keys_.end - c));
      cursor.next_rows(n, rows);
      prefetcher.advance_to(c + n);
      softmax_chunk(rows, c, n);
      accumulate_chunk(rows, n);
    }
    if (keys_.save) {
      save_states(pb_, it_, sp_, M_, s_, it_.kv_head);
    } else {
      write_outputs();
    }
  }

 private:
  int64_t row_of(int64_t m) const { return it_.row_begin + m / pb_.group; }
  int64_t head_of(int64_t m) const { return it_.kv_head * pb_.group + m % pb_.group; }

  void load_queries() {
    for (int64_t m = 0; m < M_; ++m) {
      const T* src = pb_.q + (sp_.q_begin + row_of(m)) * pb_.q_stride + head_of(m) * D;
      if constexpr (kRawKeys) {
        q_rows_[m] = src;
      } else {
        for (int d = 0; d < DV; ++d) {
          _mm512_storeu_ps(&s_.q[m * D + 16 * d], load_f32(src + 16 * d));
        }
        q_rows_[m] = &s_.q[m * D];
      }
    }
  }

  // Scores of every query vector against the chunk's keys; updates the running max and
  // sum, leaving p (and its bf16 copy) and the accumulator rescale alpha per vector.
  void softmax_chunk(const int64_t* rows, int64_t c, int n) {
    const QK* k_base;
    int64_t k_rows[kChunk];
    if constexpr (kRawKeys) {
      k_base = pb_.k_cache;
      std::copy_n(rows, n, k_rows);
    } else {
      widen_rows(pb_.k_cache, rows, n, s_.k.data());
      k_base = s_.k.data();
      std::copy_n(buffer_rows_, n, k_rows);
    }
    std::fill(k_rows + n, k_rows + kChunk, k_rows[0]);  // scored, then masked out
    const __m512 scale = _mm512_set1_ps(pb_.scale);
    for (int64_t m = 0; m < M_; ++m) {
      const int cnt = visible_keys(keys_, sp_.computed, row_of(m), c, n);
      __m512 p = _mm512_setzero_ps();
      s_.alpha[m] = 1.0f;
      if (cnt > 0) {  // else the whole chunk is in this row's future
        const __mmask16 visible = static_cast<__mmask16>((1u << cnt) - 1);
        const __m512 sc = _mm512_mul_ps(dot16<DV>(q_rows_[m], k_base, k_rows), scale);
        const float mx = std::max(s_.row_max[m], _mm512_mask_reduce_max_ps(visible, sc));
        p = _mm512_maskz_mov_ps(visible, exp_ps(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
        if (mx != s_.row_max[m]) s_.alpha[m] = std::exp(s_.row_max[m] - mx);
        s_.row_sum[m] = s_.row_sum[m] * s_.alpha[m] + _mm512_reduce_add_ps(p);
        s_.row_max[m] = mx;
      }
      _mm512_storeu_ps(&s_.p[m * kChunk], p);
#ifdef __AVX512BF16__
      if constexpr (kBf16Values) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&s_.p16[m * kChunk]),
                            (__m256i)_mm512_cvtneps_pbh(p));
      }
#endif
    }
  }

  // acc = acc * alpha + p.V over the chunk's values, in register blocks of MB vectors.
  void accumulate_chunk(const int64_t* rows, int n) {
    // Widened values are reused by every register block; with a single block, or float32
    // values, widening on the fly costs less.
    const bool widen_once = !kBf16Values && !std::is_same_v<T, float> && M_ > MB;
    if (widen_once) widen_rows(pb_.v_cache, rows, n, s_.v.data());
    for_register_blocks<MB>(M_, [&](auto mb, int64_t m) {
      constexpr int kMb = decltype(mb)::value;
      float* acc = &s_.acc[m * D];
      const float* alpha = &s_.alpha[m];
#ifdef __AVX512BF16__
      if constexpr (kBf16Values) {
        accumulate_bf16<DV / 2, kMb>(acc, D, &s_.p16[m * kChunk], alpha, pb_.v_cache, rows, n);
        return;
      }
#endif
      const float* p = &s_.p[m * kChunk];
      if (widen_once) {
        accumulate_f32<DV, kMb>(acc, D, p, alpha, s_.v.data(), buffer_rows_, n);
      } else {
        accumulate_f32<DV, kMb>(acc, D, p, alpha, pb_.v_cache, rows, n);
      }
    });
  }

  static void widen_rows(const T* base, const int64_t* rows, int n, float* dst) {
    for (int j = 0; j < n; ++j) {
      for (int d = 0; d < DV; ++d) {
        _mm512_storeu_ps(dst + j * D + 16 * d, load_f32(base + rows[j] + 16 * d));
      }
    }
  }

  void write_outputs() {
    for (int64_t m = 0; m < M_; ++m) {
      T* dst = pb_.out + (sp_.q_begin + row_of(m)) * pb_.out_stride + head_of(m) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / s_.row_sum[m]);
      const float* acc = &s_.acc[m * D];
      if constexpr (kBf16Values) {
        for (int b = 0; b < DV / 2; ++b) {
          __m512 first, second;
          unpermute_bf16_block(acc + 32 * b, first, second);
          store_f32(dst + 32 * b, _mm512_mul_ps(first, inv));
          store_f32(dst + 32 * b + 16, _mm512_mul_ps(second, inv));
        }
      } else {
        for (int d = 0; d < DV; ++d) {
          store_f32(dst + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * d), inv));
        }
      }
    }
  }

  const Problem<T>& pb_;
  const WorkItem& it_;
  Scratch& s_;
  const Span sp_;
  const ItemKeys keys_;
  const int64_t M_;
  const QK** q_rows_;
  int64_t buffer_rows_[kChunk];  // rows of a widened chunk in scratch: j * D
};

template <typename T, int DV>
void attention_item(const Problem<T>& pb, const WorkItem& it, Scratch& s) {
  AttentionItem<T, DV>(pb, it, s).run();
}

}  // namespace pagedserve::PAGEDSERVE_ISA::avx512
