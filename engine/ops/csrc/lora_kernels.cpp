// Batched LoRA on the CPU: for each adapted row of a step, y += (x A^T) Bt with its
// adapter's slot (kernels.h, LoRARows). The shrink is one dot product of the row with each
// of the adapter's A rows, rounded to the model dtype as torch stores x A^T; the expand
// accumulates those scalars times Bt's rows in float32, then the sum is rounded to the
// model dtype and added to y, as torch's `y += (x @ A.T) @ Bt` rounds.
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

template <typename T>
float dot(const T* x, const T* w, int64_t K) {
  constexpr int W = Vec::W;
  typename Vec::F acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
  int64_t k = 0;
  for (; k + 4 * W <= K; k += 4 * W) {
    for (int u = 0; u < 4; ++u) {
      acc[u] = Vec::fmadd(Vec::load(x + k + u * W), Vec::load(w + k + u * W), acc[u]);
    }
  }
  for (; k + W <= K; k += W) acc[0] = Vec::fmadd(Vec::load(x + k), Vec::load(w + k), acc[0]);
  float sum = Vec::reduce_add(Vec::add(Vec::add(acc[0], acc[1]), Vec::add(acc[2], acc[3])));
  for (; k < K; ++k) sum += to_float(x[k]) * to_float(w[k]);
  return sum;
}

// acc[0..N) += s * w[0..N)
template <typename T>
void axpy(float* acc, float s, const T* w, int64_t N) {
  constexpr int W = Vec::W;
  const typename Vec::F sv = Vec::set1(s);
  int64_t n = 0;
  for (; n + W <= N; n += W) Vec::store(acc + n, Vec::fmadd(sv, Vec::load(w + n), Vec::load(acc + n)));
  for (; n < N; ++n) acc[n] += s * to_float(w[n]);
}

}  // namespace

template <typename T>
void lora_rows(const LoRARows<T>& p, int64_t begin, int64_t end) {
  const int64_t block = p.R / p.blocks;
  thread_local std::vector<float> shrink, acc;
  shrink.resize(p.R);
  acc.resize(p.N);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = p.rows[i], slot = p.slots[i], rank = p.ranks[slot];
    const T* x = p.x + row * p.x_stride;
    const T* a = p.a + slot * p.R * p.K;
    const T* bt = p.bt + slot * p.R * p.N;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < p.blocks; ++b) {
      for (int64_t j = b * block; j < b * block + rank; ++j) {
        shrink[j] = to_float(static_cast<T>(dot(x, a + j * p.K, p.K)));
      }
    }
    for (int64_t b = 0; b < p.blocks; ++b) {
      for (int64_t j = b * block; j < b * block + rank; ++j) {
        axpy(acc.data(), shrink[j], bt + j * p.N, p.N);
      }
    }
    T* y = p.y + row * p.y_stride;
    for (int64_t n = 0; n < p.N; ++n) {
      y[n] = static_cast<T>(to_float(y[n]) + to_float(static_cast<T>(acc[n])));
    }
  }
}

template void lora_rows<float>(const LoRARows<float>&, int64_t, int64_t);
template void lora_rows<c10::BFloat16>(const LoRARows<c10::BFloat16>&, int64_t, int64_t);
template void lora_rows<c10::Half>(const LoRARows<c10::Half>&, int64_t, int64_t);

}  // namespace pagedserve::PAGEDSERVE_ISA
