// Fused elementwise kernels for a Llama-family decoder on the CPU: RMSNorm (optionally
// with the residual add), rotary embedding in place, and SiLU(gate) * up.
//
// Each reproduces the rounding of the torch ops it replaces (engine/models/layers.py and
// llama.py): every intermediate that torch stores in the model dtype is rounded to that
// dtype here too, and float32 products and sums are never fused into FMAs. Only the
// RMSNorm mean (summation order) and SiLU's exp (a different polynomial) may differ from
// torch, by float32 rounding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "attention_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#include "attention_avx512.h"
#endif

// torch rounds each product before adding it: no fused multiply-adds in this file.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace pagedserve {
namespace {

// Rows per parallel task: at least this many elements, so small decode batches stay on
// one thread instead of paying for a fork-join.
constexpr int64_t kMinElementsPerTask = 1 << 15;

int64_t grain_for(int64_t row_elements) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, row_elements));
}

// Rounds a float32 value to the model dtype and back, as storing it in a tensor would.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

#ifdef PAGEDSERVE_AVX512
using avx512::load_f32;
using avx512::store_f32;

inline __m512 round_to_vec(float*, __m512 x) { return x; }
inline __m512 round_to_vec(c10::BFloat16*, __m512 x) {
  // float32 -> bf16 (nearest even) -> float32, NaN kept.
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(r), x);
}
inline __m512 round_to_vec(c10::Half*, __m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 round_vec(__m512 x) {
  return round_to_vec(static_cast<T*>(nullptr), x);
}

#endif

// ---------------------------------------------------------------------------------------
// RMSNorm: out = weight * round(x * rsqrt(mean(x^2) + eps)), with x = round(x + residual)
// (written back to residual) when a residual is given.

template <typename T>
void rms_norm_row(T* out, T* x_row, T* residual, const T* w, int64_t H, float eps) {
  // x_row is read only when residual is null; with a residual, the sum replaces it.
  const T* x = x_row;
  if (residual != nullptr) {
    int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
    for (; d + 16 <= H; d += 16) {
      store_f32(residual + d, _mm512_add_ps(load_f32(x_row + d), load_f32(residual + d)));
    }
#endif
    for (; d < H; ++d) residual[d] = static_cast<T>(to_float(x_row[d]) + to_float(residual[d]));
    x = residual;
  }
  // torch sums in many float32 lanes; a double sum stays as close without SIMD.
  double sum = 0.0;
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= H; d += 16) {
    const __m512 v = load_f32(x + d);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; d < H; ++d) sum += to_float(x[d]) * to_float(x[d]);
  const float mean = static_cast<float>(sum) / static_cast<float>(H);
  const float inv = 1.0f / std::sqrt(mean + eps);
  d = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 inv_v = _mm512_set1_ps(inv);
  for (; d + 16 <= H; d += 16) {
    const __m512 normed = round_vec<T>(_mm512_mul_ps(load_f32(x + d), inv_v));
    store_f32(out + d, _mm512_mul_ps(load_f32(w + d), normed));
  }
#endif
  for (; d < H; ++d) {
    out[d] = static_cast<T>(to_float(w[d]) * round_to<T>(to_float(x[d]) * inv));
  }
}

template <typename T>
void rms_norm_rows(T* out, int64_t out_stride, T* x, int64_t x_stride, T* residual,
                   int64_t res_stride, const T* w, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, grain_for(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      rms_norm_row(out + r * out_stride, x + r * x_stride,
                   residual == nullptr ? nullptr : residual + r * res_stride, w, H, eps);
    }
  });
}

void check_rows(const at::Tensor& t, int64_t H, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == H && t.stride(1) == 1,
              what, " must be a CPU (rows, ", H, ") tensor with contiguous rows");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t H = weight.size(0);
  check_rows(out, H, "out");
  check_rows(x, H, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && out.size(0) == x.size(0) &&
                  x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: shapes or dtypes disagree");
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), out.stride(0), x.data_ptr<scalar_t>(),
                            x.stride(0), nullptr, 0, weight.data_ptr<scalar_t>(), x.size(0), H,
                            static_cast<float>(eps));
  });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  const int64_t H = weight.size(0);
  check_rows(x, H, "x");
  check_rows(residual, H, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && residual.size(0) == x.size(0) &&
                  x.scalar_type() == residual.scalar_type() &&
                  x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: shapes or dtypes disagree");
  dispatch_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = x.data_ptr<scalar_t>();
    rms_norm_rows<scalar_t>(xp, x.stride(0), xp, x.stride(0), residual.data_ptr<scalar_t>(),
                            residual.stride(0), weight.data_ptr<scalar_t>(), x.size(0), H,
                            static_cast<float>(eps));
  });
}

// ---------------------------------------------------------------------------------------
// Rotary embedding, rotate-half layout, in place:
//   x[:half], x[half:]  <-  round(round(x1 * c1) + round(-x2 * s1)),
//                           round(round(x2 * c2) + round(x1 * s2))

template <typename T>
void rope_head(T* x, const T* c, const T* s, int64_t half) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  for (; d + 16 <= half; d += 16) {
    const __m512 x1 = load_f32(x + d), x2 = load_f32(x + half + d);
    const __m512 c1 = load_f32(c + d), c2 = load_f32(c + half + d);
    const __m512 s1 = load_f32(s + d), s2 = load_f32(s + half + d);
    const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    const __m512 a = _mm512_add_ps(round_vec<T>(_mm512_mul_ps(x1, c1)),
                                   round_vec<T>(_mm512_mul_ps(neg_x2, s1)));
    const __m512 b = _mm512_add_ps(round_vec<T>(_mm512_mul_ps(x2, c2)),
                                   round_vec<T>(_mm512_mul_ps(x1, s2)));
    store_f32(x + d, a);
    store_f32(x + half + d, b);
  }
#endif
  for (; d < half; ++d) {
    const float x1 = to_float(x[d]), x2 = to_float(x[half + d]);
    const float a = round_to<T>(x1 * to_float(c[d])) + round_to<T>(-x2 * to_float(s[d]));
    const float b =
        round_to<T>(x2 * to_float(c[half + d])) + round_to<T>(x1 * to_float(s[half + d]));
    x[d] = static_cast<T>(a);
    x[half + d] = static_cast<T>(b);
  }
}

void check_heads(const at::Tensor& t, int64_t D, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(2) == D && t.stride(2) == 1 &&
                  t.stride(1) == D,
              what, " must be a CPU (tokens, heads, ", D, ") tensor with contiguous heads");
}

void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  const int64_t T = q.size(0), D = q.size(-1);
  check_heads(q, D, "q");
  check_heads(k, D, "k");
  TORCH_CHECK(D % 2 == 0 && k.size(0) == T, "rotary_embedding: q and k disagree");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == T * D && t->scalar_type() == q.scalar_type(),
                "rotary_embedding: cos and sin must be contiguous (tokens, [1,] head_dim) ",
                "in q's dtype");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "rotary_embedding: q and k dtypes differ");
  const int64_t hq = q.size(1), hk = k.size(1);
  dispatch_dtype(q.scalar_type(), "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
    at::parallel_for(0, T, grain_for((hq + hk) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        for (int64_t h = 0; h < hq; ++h) rope_head(qp + t * q_stride + h * D, c, s, D / 2);
        for (int64_t h = 0; h < hk; ++h) rope_head(kp + t * k_stride + h * D, c, s, D / 2);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------
// SwiGLU: out = round(round(silu(gate)) * up), gate_up = [gate | up] per row.

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t I) {
  int64_t d = 0;
#ifdef PAGEDSERVE_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; d + 16 <= I; d += 16) {
    const __m512 g = load_f32(gate + d);
    const __m512 e = avx512::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_vec<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    store_f32(out + d, _mm512_mul_ps(silu, load_f32(up + d)));
  }
#endif
  for (; d < I; ++d) {
    const float g = to_float(gate[d]);
    out[d] = static_cast<T>(round_to<T>(g / (1.0f + std::exp(-g))) * to_float(up[d]));
  }
}

void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t I = out.size(-1);
  check_rows(out, I, "out");
  check_rows(gate_up, 2 * I, "gate_up");
  TORCH_CHECK(out.size(0) == gate_up.size(0) && out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: shapes or dtypes disagree");
  dispatch_dtype(out.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    at::parallel_for(0, out.size(0), grain_for(I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * gate_up.stride(0);
        silu_and_mul_row(op + r * out.stride(0), g, g + I, I);
      }
    });
  });
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &pagedserve::rms_norm);
  m.impl("fused_add_rms_norm", &pagedserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &pagedserve::rotary_embedding);
  m.impl("silu_and_mul", &pagedserve::silu_and_mul);
}
