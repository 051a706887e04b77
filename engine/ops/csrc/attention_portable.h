// The portable paged-attention item kernel: the whole kernel of the portable instruction
// set, and the AVX-512 sets' kernel for head sizes they have no instantiation for.
//
// It computes in GCC/Clang generic vectors of the target's native SIMD width (AVX: 8
// floats; SSE, NEON and others: 4), so the compiler maps each vector operation onto one
// instruction. Rows are widened to float32 a chunk at a time; the algorithm is the
// AVX-512 path's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention_common.h"

namespace pagedserve::PAGEDSERVE_ISA::portable {

#if defined(__AVX__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif
constexpr int kVecsPerChunk = kChunk / kWidth;

typedef float Vec __attribute__((vector_size(kWidth * sizeof(float))));
typedef int32_t IntVec __attribute__((vector_size(kWidth * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec splat(float x) { return Vec{} + x; }
inline float reduce_add(Vec v) {
  float sum = 0.0f;
  for (int l = 0; l < kWidth; ++l) sum += v[l];
  return sum;
}

// exp(x) for x <= 0: the AVX-512 path's polynomial, lane-wise.
inline Vec exp_nonpositive(Vec x) {
  const IntVec low = x < splat(-87.0f);
  x = (Vec)(((IntVec)x & ~low) | ((IntVec)splat(-87.0f) & low));
  const Vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to int
  Vec r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Vec y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + (r + 1.0f);
  const IntVec two_n = (__builtin_convertvector(n, IntVec) + 127) << 23;  // n in [-126, 0]
  return y * (Vec)two_n;
}

// p[m][j] = q[m] . k[j] for the chunk's n keys (lanes j >= n are left unspecified).
inline void chunk_scores(const float* q, int64_t M, const float* kf, float* kt, int n,
                         int64_t D, float* p) {
  if (M < 8) {  // decodes: one dot product per key, over kWidth partial sums
    for (int64_t m = 0; m < M; ++m) {
      int j = 0;
      // Four keys at a time, so that their chains of multiply-adds overlap; each key's
      // sum is formed in the same order as below.
      for (; j + 4 <= n; j += 4) {
        Vec partial[4] = {};
        int64_t d = 0;
        for (; d + kWidth <= D; d += kWidth) {
          const Vec qv = load(q + m * D + d);
          for (int u = 0; u < 4; ++u) partial[u] += qv * load(kf + (j + u) * D + d);
        }
        for (int u = 0; u < 4; ++u) {
          float sum = reduce_add(partial[u]);
          for (int64_t e = d; e < D; ++e) sum += q[m * D + e] * kf[(j + u) * D + e];
          p[m * kChunk + j + u] = sum;
        }
      }
      for (; j < n; ++j) {
        Vec partial = {};
        int64_t d = 0;
        for (; d + kWidth <= D; d += kWidth) partial += load(q + m * D + d) * load(kf + j * D + d);
        float sum = reduce_add(partial);
        for (; d < D; ++d) sum += q[m * D + d] * kf[j * D + d];
        p[m * kChunk + j] = sum;
      }
    }
    return;
  }
  // Prefill tiles: transpose the keys once, then each query is 16 independent lanes per d.
  std::fill_n(kt, D * kChunk, 0.0f);
  for (int j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; ++d) kt[d * kChunk + j] = kf[j * D + d];
  }
  for (int64_t m = 0; m < M; ++m) {
    Vec scores[kVecsPerChunk] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float qd = q[m * D + d];
      for (int v = 0; v < kVecsPerChunk; ++v) scores[v] += qd * load(kt + d * kChunk + v * kWidth);
    }
    for (int v = 0; v < kVecsPerChunk; ++v) store(p + m * kChunk + v * kWidth, scores[v]);
  }
}

// p[0..16) = exp(p - mx) for the first cnt lanes, 0 for the rest; returns their sum.
inline float exp_chunk(float* p, float mx, int cnt) {
  Vec sum = {};
  for (int v = 0; v < kVecsPerChunk; ++v) {
    IntVec lane;
    for (int l = 0; l < kWidth; ++l) lane[l] = v * kWidth + l;
    const IntVec visible = lane < cnt;
    const Vec e = (Vec)((IntVec)exp_nonpositive(load(p + v * kWidth) - mx) & visible);
    store(p + v * kWidth, e);
    sum += e;
  }
  return reduce_add(sum);
}

// acc = acc * alpha + sum_j p[j] * v[j]. Up to kAccVecs vectors of acc stay in registers
// while the keys stream by, so each is its own chain of multiply-adds: with one vector at a
// time, every add waited on the one before it (a decode's values took 3-4x as long). Each
// lane adds the same terms in the same order either way.
constexpr int kAccVecs = 8;

inline void accumulate_values(float* acc, float alpha, const float* p, const float* v, int n,
                              int64_t D) {
  int64_t d = 0;
  for (; d + kAccVecs * kWidth <= D; d += kAccVecs * kWidth) {
    Vec a[kAccVecs];
    for (int i = 0; i < kAccVecs; ++i) a[i] = load(acc + d + i * kWidth) * alpha;
    for (int j = 0; j < n; ++j) {
      const Vec pj = splat(p[j]);
      const float* vj = v + j * D + d;
      for (int i = 0; i < kAccVecs; ++i) a[i] += pj * load(vj + i * kWidth);
    }
    for (int i = 0; i < kAccVecs; ++i) store(acc + d + i * kWidth, a[i]);
  }
  for (; d + kWidth <= D; d += kWidth) {
    Vec a = load(acc + d) * alpha;
    for (int j = 0; j < n; ++j) a += p[j] * load(v + j * D + d);
    store(acc + d, a);
  }
  for (; d < D; ++d) {
    float a = acc[d] * alpha;
    for (int j = 0; j < n; ++j) a += p[j] * v[j * D + d];
    acc[d] = a;
  }
}

template <typename T>
void attention_item(const Problem<T>& pb, const WorkItem& it, Scratch& s) {
  const int64_t D = pb.head_dim, G = pb.group, h = it.kv_head;
  const Span sp = span_of(pb, it.req);
  const int64_t M = (it.row_end - it.row_begin) * G;  // query vectors (row, head in group)
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = it.row_begin + m / G, head = h * G + m % G;
    const T* src = pb.q + (sp.q_begin + i) * pb.q_stride + head * D;
    for (int64_t d = 0; d < D; ++d) s.q[m * D + d] = to_float(src[d]) * pb.scale;
  }
  start_states(pb, it, sp, M, s, h);
  const ItemKeys keys = keys_of(sp, it);
  PageCursor cursor = cursor_for(pb, sp, h, keys.begin);
  Prefetcher<T> prefetcher{pb.k_cache, pb.v_cache, cursor, keys.end,
                           D * static_cast<int64_t>(sizeof(T)), keys.begin};
  prefetcher.advance_to(keys.begin);
  float* kf = s.k.data();  // kf[j * D + d]: the chunk's keys in float32
  float* vf = s.v.data();
  int64_t rows[kChunk];
  for (int64_t c = keys.begin; c < keys.end; c += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, keys.end - c));
    cursor.next_rows(n, rows);
    prefetcher.advance_to(c + n);
    for (int j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; ++d) {
        kf[j * D + d] = to_float(pb.k_cache[rows[j] + d]);
        vf[j * D + d] = to_float(pb.v_cache[rows[j] + d]);
      }
    }
    chunk_scores(s.q.data(), M, kf, s.kt.data(), n, D, s.p.data());
    for (int64_t m = 0; m < M; ++m) {
      const int cnt = visible_keys(keys, sp.computed, it.row_begin + m / G, c, n);
      if (cnt == 0) continue;  // the whole chunk is in this row's future
      float* p = &s.p[m * kChunk];
      float mx = s.row_max[m];
      for (int j = 0; j < cnt; ++j) mx = std::max(mx, p[j]);
      const float sum = exp_chunk(p, mx, cnt);
      const float alpha = std::exp(s.row_max[m] - mx);
      s.row_max[m] = mx;
      s.row_sum[m] = s.row_sum[m] * alpha + sum;
      accumulate_values(&s.acc[m * D], alpha, p, vf, cnt, D);
    }
  }
  if (keys.save) return save_states(pb, it, sp, M, s, h);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t i = it.row_begin + m / G, head = h * G + m % G;
    T* dst = pb.out + (sp.q_begin + i) * pb.out_stride + head * D;
    const float inv = 1.0f / s.row_sum[m];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.acc[m * D + d] * inv);
  }
}

}  // namespace pagedserve::PAGEDSERVE_ISA::portable
