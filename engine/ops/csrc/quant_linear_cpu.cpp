// Weight-only quantized linear layers on the CPU: y = x W^T, W (N, K) quantized in blocks of
// 32 weights along K, as GGUF's Q4_0, Q4_1 and Q8_0 and pagedserve's int8/int4 are.
//
//   4-bit (affine): w = d[n, g] * q + m[n, g], q in 0..15
//   8-bit (scaled): w = d[n, g] * q,           q in -128..127
//
// with float16 d and m per group g of `group_size` weights (a multiple of 32). Activations
// are float32 or bfloat16; every product and sum is float32, so the result equals
// x @ dequantize(W)^T up to the order of float32 additions.
//
// Layout (made by engine/models/quantized.py's pack_tiles): 16 output rows form a tile,
// and a vector's 16 float32 lanes are a tile's 16 rows, so a tile's outputs accumulate
// lane-wise with no horizontal sums, and each unpacked weight vector serves every row of x.
//
//   8-bit  q: (N/16, K/32, 32, 16) int8   [tile][block][k in block][row in tile]
//   4-bit  q: (N/16, K/32, 16, 16) uint8  [tile][block][k pair][byte]; byte 2a + p holds
//             rows a (low nibble) and a + 8 (high nibble) at k = 2 * pair + p
//   d, m:     (N/16, K/group, 16) float16 [tile][group][row in tile]
//
// The 4-bit byte order is what AVX512-BF16 wants: broadcasting a pair's 16 bytes to both
// halves of a ymm, shifting the second half right by 4 and masking gives 32 nibbles; widened
// to 16-bit words and OR-ed into 0x4300 they are the bfloat16 numbers 128 + q (exact:
// bfloat16's spacing at 128 is 1), and lane i of vdpbf16ps with the broadcast activation
// pair (x[k], x[k+1]) adds row i's two products, each exact in float32. Then
//
//   sum_{k in g} w x = d * sum_{k in g} (128 + q) x + (m - 128 d) * xsum[g]
//
// still exact up to float32 rounding of the sums, though the 128 offset spends about seven
// of float32's 24 bits on cancellation: far below a bfloat16 output's 8. float32 activations
// take the plain float32 path (the nibbles widened to float32), which has no offset.
//
// The AVX-512 paths are compiled for their ISA by function attributes and chosen at run
// time from the CPU's features, so this file builds with any -march and runs anywhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PAGEDSERVE_QUANT_X86 1
#define PAGEDSERVE_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define PAGEDSERVE_AVX512_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#endif

namespace pagedserve {
namespace {

constexpr int64_t kTile = 16;   // output rows per tile (vector lanes)
constexpr int64_t kBlock = 32;  // weights per block along K
// Rows of x per pass over the weights: each unpacked weight vector serves this many.
constexpr int64_t kRowTile = 8;
// Weights per parallel task: enough that a fork-join pays for itself.
constexpr int64_t kMinWeightsPerTask = 1 << 16;

struct TiledWeight {
  const uint8_t* q;
  const at::Half* d;
  const at::Half* m;  // 4-bit only
  int64_t N, K, group;
  int bits;

  int64_t tiles() const { return (N + kTile - 1) / kTile; }
  int64_t blocks() const { return K / kBlock; }
  int64_t groups() const { return K / group; }
  int64_t block_bytes() const { return bits == 4 ? kTile * kBlock / 2 : kTile * kBlock; }
  const uint8_t* block(int64_t t, int64_t b) const {
    return q + (t * blocks() + b) * block_bytes();
  }
  // Weight (n, k) as an integer: q for 4 bits (0..15), q for 8 bits (-128..127).
  int value(int64_t n, int64_t k) const {
    const int64_t t = n / kTile, row = n % kTile, b = k / kBlock, kk = k % kBlock;
    const uint8_t* blk = block(t, b);
    if (bits == 8) return static_cast<int8_t>(blk[kk * kTile + row]);
    const uint8_t byte = blk[(kk / 2) * kTile + 2 * (row % 8) + kk % 2];
    return row < 8 ? (byte & 0x0F) : (byte >> 4);
  }
  float scale(int64_t n, int64_t g) const {
    return static_cast<float>(d[(n / kTile * groups() + g) * kTile + n % kTile]);
  }
  float min(int64_t n, int64_t g) const {
    return static_cast<float>(m[(n / kTile * groups() + g) * kTile + n % kTile]);
  }
};

// One pass's rows of x: float32 copies, group sums, and bfloat16 originals (bf16 path).
struct Rows {
  const float* x;          // (count, K)
  const at::BFloat16* xb;  // (count, K) or null
  const float* xsum;       // (count, groups)
  int64_t count;
};

// Where a pass's outputs go: row r of y at float32 or bfloat16 `data` + r * N.
struct Out {
  void* data;
  bool bf16;
};

// Computes y[r, t * 16 + i] for the rows of `a`, tile t.
using TileKernel = void (*)(const TiledWeight&, int64_t t, const Rows& a, Out out);

// Stores one row's tile of outputs, rounding to bfloat16 (nearest even) when the output is.
void store_tile(const TiledWeight& w, int64_t t, const float* lanes, Out out, int64_t r) {
  const int64_t n0 = t * kTile, count = std::min(kTile, w.N - n0);
  if (out.bf16) {
    at::BFloat16* dst = static_cast<at::BFloat16*>(out.data) + r * w.N + n0;
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<at::BFloat16>(lanes[i]);
  } else {
    std::memcpy(static_cast<float*>(out.data) + r * w.N + n0, lanes, count * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------
// Portable path: plain loops, the reference for the vector paths' arithmetic.

void tile_portable(const TiledWeight& w, int64_t t, const Rows& a, Out out) {
  const int64_t groups = w.groups();
  for (int64_t r = 0; r < a.count; ++r) {
    const float* x = a.x + r * w.K;
    float lanes[kTile];
    for (int64_t i = 0; i < kTile; ++i) {
      const int64_t n = std::min(t * kTile + i, w.N - 1);
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
          acc += static_cast<float>(w.value(n, k)) * x[k];
        }
        total += w.scale(n, g) * acc;
        if (w.bits == 4) total += w.min(n, g) * a.xsum[r * groups + g];
      }
      lanes[i] = total;
    }
    store_tile(w, t, lanes, out, r);
  }
}

#ifdef PAGEDSERVE_QUANT_X86

PAGEDSERVE_AVX512_TARGET inline __m512 load_f16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

PAGEDSERVE_AVX512_TARGET inline void store_lanes(const TiledWeight& w, int64_t t, __m512 v,
                                                 Out out, int64_t r) {
  alignas(64) float lanes[kTile];
  _mm512_store_ps(lanes, v);
  store_tile(w, t, lanes, out, r);
}

// ---------------------------------------------------------------------------------------
// float32 path: per k, the tile's 16 weights as floats, times the broadcast x[k].

// The 16 rows' weights at k = 2 * pair + p of a 4-bit block, widened to int32 lanes.
PAGEDSERVE_AVX512_TARGET inline void unpack4_pair(const uint8_t* pair_bytes, __m512i* even,
                                                  __m512i* odd) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair_bytes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(raw, mask);                      // rows 0..7
  const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // rows 8..15
  // Bytes 2a are k = 2 pair, bytes 2a + 1 are k + 1: gather each parity's 8 rows.
  const __m128i parity = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i lo = _mm_shuffle_epi8(low, parity), hi = _mm_shuffle_epi8(high, parity);
  *even = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
  *odd = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(lo, hi));
}

template <int64_t R>
PAGEDSERVE_AVX512_TARGET void tile_f32(const TiledWeight& w, int64_t t, const Rows& a,
                                       Out out) {
  const int64_t groups = w.groups(), blocks_per_group = w.group / kBlock;
  __m512 acc[R], part[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      const int64_t k0 = b * kBlock;
      if (w.bits == 8) {
        for (int64_t kk = 0; kk < kBlock; ++kk) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kk * kTile));
          const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
          for (int64_t r = 0; r < R; ++r) {
            part[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(a.x[r * w.K + k0 + kk]), part[r]);
          }
        }
        continue;
      }
      for (int64_t pair = 0; pair < kBlock / 2; ++pair) {
        __m512i even, odd;
        unpack4_pair(blk + pair * kTile, &even, &odd);
        const __m512 we = _mm512_cvtepi32_ps(even), wo = _mm512_cvtepi32_ps(odd);
        for (int64_t r = 0; r < R; ++r) {
          const float* x = a.x + r * w.K + k0 + 2 * pair;
          part[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(x[0]), part[r]);
          part[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x[1]), part[r]);
        }
      }
    }
    const __m512 dv = load_f16(w.d + (t * groups + g) * kTile);
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], dv, acc[r]);
    if (w.bits == 4) {
      const __m512 mv = load_f16(w.m + (t * groups + g) * kTile);
      for (int64_t r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) store_lanes(w, t, acc[r], out, r);
}

// ---------------------------------------------------------------------------------------
// AVX512-BF16 path, 4-bit weights and bfloat16 activations (see the header comment).

template <int64_t R>
PAGEDSERVE_AVX512_BF16_TARGET void tile_bf16(const TiledWeight& w, int64_t t, const Rows& a,
                                             Out out) {
  // With few rows of x, alternate partial sums so consecutive dot products do not wait on
  // each other's latency.
  constexpr int64_t P = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  const int64_t groups = w.groups(), blocks_per_group = w.group / kBlock;
  const __m256i shifts = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  __m512 acc[R], part[R][P];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t p = 0; p < P; ++p) part[r][p] = _mm512_setzero_ps();
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* blk = w.block(t, b);
      const int64_t k0 = b * kBlock;
      for (int64_t pair0 = 0; pair0 < kBlock / 2; pair0 += P) {
#pragma GCC unroll 4
        for (int64_t p = 0; p < P; ++p) {
          const int64_t pair = pair0 + p;
          const auto* bytes = reinterpret_cast<const __m128i*>(blk + pair * kTile);
          const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(bytes));
          const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi16(both, shifts), nibble);
          const __m512bh wv = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(nibbles), bf16_128);
#pragma GCC unroll 8
          for (int64_t r = 0; r < R; ++r) {
            int32_t x_pair;
            std::memcpy(&x_pair, a.xb + r * w.K + k0 + 2 * pair, sizeof(x_pair));
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(x_pair);
            part[r][p] = _mm512_dpbf16_ps(part[r][p], wv, xv);
          }
        }
      }
    }
    const __m512 dv = load_f16(w.d + (t * groups + g) * kTile);
    const __m512 mv = load_f16(w.m + (t * groups + g) * kTile);
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), dv, mv);  // m - 128 d
    for (int64_t r = 0; r < R; ++r) {
      __m512 sum = part[r][0];
      for (int64_t p = 1; p < P; ++p) sum = _mm512_add_ps(sum, part[r][p]);
      acc[r] = _mm512_fmadd_ps(sum, dv, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a.xsum[r * groups + g]), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) store_lanes(w, t, acc[r], out, r);
}

#define PAGEDSERVE_ROW_SWITCH(KERNEL)                       \
  switch (a.count) {                                        \
    case 8: return KERNEL<8>(w, t, a, out);                 \
    case 7: return KERNEL<7>(w, t, a, out);                 \
    case 6: return KERNEL<6>(w, t, a, out);                 \
    case 5: return KERNEL<5>(w, t, a, out);                 \
    case 4: return KERNEL<4>(w, t, a, out);                 \
    case 3: return KERNEL<3>(w, t, a, out);                 \
    case 2: return KERNEL<2>(w, t, a, out);                 \
    default: return KERNEL<1>(w, t, a, out);                \
  }

void tile_rows_f32(const TiledWeight& w, int64_t t, const Rows& a, Out out) {
  PAGEDSERVE_ROW_SWITCH(tile_f32)
}

void tile_rows_bf16(const TiledWeight& w, int64_t t, const Rows& a, Out out) {
  PAGEDSERVE_ROW_SWITCH(tile_bf16)
}

bool cpu_has_avx512() {
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

enum class Path { kPortable, kF32, kBF16 };

Path pick_path(int bits, bool bf16_input, bool portable) {
#ifdef PAGEDSERVE_QUANT_X86
  if (portable || !cpu_has_avx512()) return Path::kPortable;
  if (bf16_input && bits == 4 && cpu_has_avx512_bf16()) return Path::kBF16;
  return Path::kF32;
#else
  return Path::kPortable;
#endif
}

TileKernel kernel_for(Path path) {
#ifdef PAGEDSERVE_QUANT_X86
  if (path == Path::kBF16) return tile_rows_bf16;
  if (path == Path::kF32) return tile_rows_f32;
#endif
  return tile_portable;
}

TiledWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                         int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized weights are 4 or 8 bits, not ", bits);
  TORCH_CHECK(group > 0 && group % kBlock == 0, "group_size must be a multiple of 32, got ",
              group);
  TORCH_CHECK(qweight.dim() == 4 && qweight.is_contiguous() && qweight.size(3) == kTile,
              "qweight must be tiled (tiles, K/32, k, 16) and contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "4-bit weights are uint8 nibble pairs, 8-bit weights int8");
  TORCH_CHECK(qweight.size(2) == (bits == 4 ? kBlock / 2 : kBlock), "wrong block shape");
  const int64_t tiles = qweight.size(0), K = qweight.size(1) * kBlock;
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "N=", N, " does not fit ", tiles,
              " tiles");
  TORCH_CHECK(K % group == 0, "K=", K, " is not a multiple of group_size=", group);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == tiles * (K / group) * kTile,
              "scales must be contiguous float16 (tiles, K / group_size, 16)");
  const at::Half* m = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                    mins->numel() == scales.numel(),
                "4-bit weights need float16 mins shaped like scales");
    m = mins->data_ptr<at::Half>();
  }
  return TiledWeight{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<at::Half>(),
                     m, N, K, group, static_cast<int>(bits)};
}

at::Tensor quant_linear_impl(const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                             int64_t bits, int64_t group, int64_t N, bool portable) {
  const TiledWeight w = check_weight(qweight, scales, mins, bits, group, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be (M, ", w.K, ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = w.K, groups = w.groups();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Path path = pick_path(w.bits, bf16, portable);
  const at::Tensor xc = x.contiguous();
  // x in float32 and its group sums, made here rather than with torch ops: a decode step
  // runs this for every linear layer, and each extra op costs dispatch time.
  std::vector<float> x32(M * K), xsum(M * groups, 0.f);
  for (int64_t i = 0; i < M * K; ++i) {
    x32[i] = bf16 ? static_cast<float>(xc.data_ptr<at::BFloat16>()[i]) : xc.data_ptr<float>()[i];
  }
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t k = 0; k < K; ++k) xsum[r * groups + k / group] += x32[r * K + k];
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const TileKernel kernel = kernel_for(path);
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / (kTile * K));
  at::parallel_for(0, w.tiles(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) {
      const Rows rows{x32.data() + r0 * K,
                      path == Path::kBF16 ? xc.data_ptr<at::BFloat16>() + r0 * K : nullptr,
                      xsum.data() + r0 * groups, std::min(kRowTile, M - r0)};
      char* base = static_cast<char*>(out.data_ptr()) + r0 * N * out.element_size();
      for (int64_t t = begin; t < end; ++t) kernel(w, t, rows, Out{base, bf16});
    }
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                        int64_t N) {
  return quant_linear_impl(x, qweight, scales, mins, bits, group, N, /*portable=*/false);
}

at::Tensor quant_linear_portable(const at::Tensor& x, const at::Tensor& qweight,
                                 const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                 int64_t bits, int64_t group, int64_t N) {
  return quant_linear_impl(x, qweight, scales, mins, bits, group, N, /*portable=*/true);
}

std::string quant_linear_path(int64_t bits, bool bf16_input) {
  switch (pick_path(static_cast<int>(bits), bf16_input, false)) {
    case Path::kBF16: return "avx512-bf16";
    case Path::kF32: return "avx512";
    default: return "portable";
  }
}

// Dequantizes rows (all N when `rows` is absent) into `dtype`: (R, K).
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                            int64_t N, const c10::optional<at::Tensor>& rows,
                            at::ScalarType dtype) {
  const TiledWeight w = check_weight(qweight, scales, mins, bits, group, N);
  const at::Tensor index = rows.has_value() ? rows->to(at::kLong).contiguous()
                                            : at::arange(N, qweight.options().dtype(at::kLong));
  TORCH_CHECK(index.dim() == 1, "rows must be 1-D");
  const int64_t R = index.numel();
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < N, "row ", ids[i], " is out of range [0, ", N, ")");
  }
  at::Tensor out32 = at::empty({R, w.K}, qweight.options().dtype(at::kFloat));
  float* out = out32.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kMinWeightsPerTask / w.K);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = ids[i];
      for (int64_t g = 0; g < w.groups(); ++g) {
        const float d = w.scale(n, g), m = w.bits == 4 ? w.min(n, g) : 0.f;
        for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
          out[i * w.K + k] = d * static_cast<float>(w.value(n, k)) + m;
        }
      }
    }
  });
  return dtype == at::kFloat ? out32 : out32.to(dtype);
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def(
      "quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int n) -> Tensor");
  m.def(
      "quant_linear_portable(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int bits, "
      "int group_size, int n) -> Tensor");
  m.def("quant_linear_path(int bits, bool bf16_input) -> str", &pagedserve::quant_linear_path);
  m.def(
      "quant_dequantize(Tensor qweight, Tensor scales, Tensor? mins, int bits, int group_size, "
      "int n, Tensor? rows, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("quant_linear", &pagedserve::quant_linear);
  m.impl("quant_linear_portable", &pagedserve::quant_linear_portable);
  m.impl("quant_dequantize", &pagedserve::quant_dequantize);
}
