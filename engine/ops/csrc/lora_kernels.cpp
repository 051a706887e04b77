// Batched LoRA on the CPU: for each adapted row of a step, y += (x A^T) Bt with its
// adapter's slot (kernels.h, LoRARows). The shrink is one dot product of the row with each
// of the adapter's A rows, rounded to the model dtype as torch stores x A^T; the expand
// accumulates those scalars times Bt's rows (their block's output slice only) in float32,
// then the sum is rounded to the model dtype and added to y, as torch's
// `y += (x @ A.T) @ Bt` rounds. A work item is up to kLoRARowsPerItem rows of one adapter,
// so that each of its weights is read once for all of them.
//
// Written once over the instruction set's vector struct (simd_*.h: Vec512, Vec256, or the
// portable VecGeneric), compiled once per set (kernels.h).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_common.h"
#include "kernels.h"
#include "simd_portable.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#endif

namespace pagedserve::PAGEDSERVE_ISA {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
using Vec = avx512::Vec512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using Vec = avx2::Vec256;
#else
using Vec = VecGeneric;
#endif

// out[r] = x[r] . w for the `rows` rows of x (stride xs): w is read once for all of them.
template <typename T>
void dots(const T* x, int64_t xs, int rows, const T* w, int64_t K, float* out) {
  constexpr int W = Vec::W;
  typename Vec::F acc[kLoRARowsPerItem];
  for (int r = 0; r < rows; ++r) acc[r] = Vec::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    const typename Vec::F wv = Vec::load(w + k);
    for (int r = 0; r < rows; ++r) acc[r] = Vec::fmadd(Vec::load(x + r * xs + k), wv, acc[r]);
  }
  for (int r = 0; r < rows; ++r) {
    float sum = Vec::reduce_add(acc[r]);
    for (int64_t kk = k; kk < K; ++kk) sum += to_float(x[r * xs + kk]) * to_float(w[kk]);
    out[r] = sum;
  }
}

// acc[r][0..n) += s[r] * w[0..n) for the `rows` rows (acc stride as): w read once.
template <typename T>
void axpys(float* acc, int64_t as, int rows, const float* s, const T* w, int64_t n) {
  constexpr int W = Vec::W;
  typename Vec::F sv[kLoRARowsPerItem];
  for (int r = 0; r < rows; ++r) sv[r] = Vec::set1(s[r]);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    const typename Vec::F wv = Vec::load(w + c);
    for (int r = 0; r < rows; ++r) {
      float* dst = acc + r * as + c;
      Vec::store(dst, Vec::fmadd(sv[r], wv, Vec::load(dst)));
    }
  }
  for (; c < n; ++c) {
    const float wc = to_float(w[c]);
    for (int r = 0; r < rows; ++r) acc[r * as + c] += s[r] * wc;
  }
}

}  // namespace

template <typename T>
void lora_rows(const LoRARows<T>& p, int64_t begin, int64_t end) {
  const int64_t block = p.R / p.blocks;
  thread_local std::vector<float> acc;
  acc.resize(p.N * kLoRARowsPerItem);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row0 = p.item_rows[i], slot = p.item_slots[i], rank = p.ranks[slot];
    const int rows = static_cast<int>(p.item_counts[i]);
    const T* x = p.x + row0 * p.x_stride;
    const T* a = p.a + slot * p.R * p.K;
    const T* bt = p.bt + slot * p.R * p.N;
    std::fill(acc.begin(), acc.begin() + rows * p.N, 0.0f);
    float s[kLoRARowsPerItem];
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t c0 = p.col_offsets[b], cols = p.col_offsets[b + 1] - c0;
      for (int64_t j = b * block; j < b * block + rank; ++j) {
        dots(x, p.x_stride, rows, a + j * p.K, p.K, s);
        // x A^T as torch stores it: rounded to the model dtype.
        for (int r = 0; r < rows; ++r) s[r] = to_float(static_cast<T>(s[r]));
        axpys(acc.data() + c0, p.N, rows, s, bt + j * p.N + c0, cols);
      }
    }
    for (int r = 0; r < rows; ++r) {
      T* y = p.y + (row0 + r) * p.y_stride;
      const float* sum = acc.data() + r * p.N;
      for (int64_t n = 0; n < p.N; ++n) {
        y[n] = static_cast<T>(to_float(y[n]) + to_float(static_cast<T>(sum[n])));
      }
    }
  }
}

template void lora_rows<float>(const LoRARows<float>&, int64_t, int64_t);
template void lora_rows<c10::BFloat16>(const LoRARows<c10::BFloat16>&, int64_t, int64_t);
template void lora_rows<c10::Half>(const LoRARows<c10::Half>&, int64_t, int64_t);

}  // namespace pagedserve::PAGEDSERVE_ISA
