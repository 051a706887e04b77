// The bfloat16 linear's tiles for AVX2 CPUs, which have no bfloat16 dot product. Included
// by bf16_linear_kernels.cpp inside its namespace, in the AVX2 set only.
//
// Same layout, (tiles, K/2, 16, 2): a pair's 64 bytes are two 256-bit vectors, rows 0..7
// then 8..15, each 32-bit lane holding one row's (w[k], w[k+1]). A bfloat16 is the top half
// of a float32, so
//
//   w[k]     = lane << 16           (vpslld)
//   w[k + 1] = lane & 0xFFFF0000    (vpand)
//
// are the float32 weights, exactly, and two FMAs with the broadcast x[k] and x[k + 1] add
// the pair's products: float32 products of bfloat16 numbers are exact, so the result equals
// the dot-product kernel's and oneDNN's up to the order of float32 additions. x is widened
// to float32 once per call, so a broadcast is a load.

// Rows of x per pass: 4 rows x 2 halves of accumulators, the 4 weight vectors and the two
// broadcasts fill AVX2's 16 registers.
constexpr int64_t kFmaRows = 4;
// As the dot-product kernel: 8 KB ahead into L2.
constexpr int64_t kFmaPrefetchAhead = 8192;

// Stores R rows' tile of float32 sums (each row's two halves) as bfloat16, nearest even.
template <int64_t R>
inline void store_tile_rows(const Bf16Weight& w, int64_t t, __m256 (&acc)[R][2],
                            Bf16Out y) {
  alignas(32) float lanes[R][Bf16Weight::kTile];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) {
    _mm256_store_ps(lanes[r], acc[r][0]);
    _mm256_store_ps(lanes[r] + 8, acc[r][1]);
  }
  const int64_t n0 = t * Bf16Weight::kTile, count = std::min(Bf16Weight::kTile, w.N - n0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < count; ++i) y.put(r * w.N + n0 + i, round_bf16(lanes[r][i]));
  }
}

template <int64_t R>
void tile_fma(const Bf16Weight& w, int64_t t, const float* x, Bf16Out y) {
  // One row alternates two partial sums, so consecutive FMAs do not wait on each other.
  constexpr int64_t P = R == 1 ? 2 : 1;
  const int64_t pairs = w.K / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[P][R][2];
#pragma GCC unroll 2
  for (int64_t p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) acc[p][r][0] = acc[p][r][1] = _mm256_setzero_ps();
  }
  const c10::BFloat16* tile = w.tile(t);
  const float* xr[R];  // as widening_fma
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) xr[r] = x + r * w.K;
  auto step = [&](int64_t pair, int64_t p) {
    const c10::BFloat16* line = tile + pair * 2 * Bf16Weight::kTile;
    _mm_prefetch(reinterpret_cast<const char*>(line) + kFmaPrefetchAhead, _MM_HINT_T1);
    __m256 even[2], odd[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line) + h);
      even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(xr[r] + 2 * pair);
      const __m256 x1 = _mm256_broadcast_ss(xr[r] + 2 * pair + 1);
      for (int h = 0; h < 2; ++h) {
        acc[p][r][h] = _mm256_fmadd_ps(even[h], x0, acc[p][r][h]);
        acc[p][r][h] = _mm256_fmadd_ps(odd[h], x1, acc[p][r][h]);
      }
    }
  };
  int64_t pair = 0;
  for (; pair + P <= pairs; pair += P) {
    for (int64_t p = 0; p < P; ++p) step(pair + p, p);
  }
  for (; pair < pairs; ++pair) step(pair, 0);
  // Every loop over acc is unrolled: one that is not makes GCC keep acc in memory and store
  // all of it back on every pair (4 rows: 60 GFLOP/s a thread with the stores, 83 without).
  __m256 sum[R][2];
#pragma GCC unroll 4
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      sum[r][h] = acc[0][r][h];
      if constexpr (P == 2) sum[r][h] = _mm256_add_ps(sum[r][h], acc[1][r][h]);
    }
  }
  store_tile_rows<R>(w, t, sum, y);
}

void tile_rows_fma(const Bf16Weight& w, int64_t t, const float* x, int64_t rows,
                   Bf16Out y) {
  switch (rows) {
    case 4: return tile_fma<4>(w, t, x, y);
    case 3: return tile_fma<3>(w, t, x, y);
    case 2: return tile_fma<2>(w, t, x, y);
    default: return tile_fma<1>(w, t, x, y);
  }
}

// Steps of many rows widen each tile to float32 once, into a panel (K, 16) of the thread's,
// and run the float32 GEMM microkernel over it: up to kPanelRows rows x 16 columns, 12
// accumulators, so the FMAs are never waiting on one another (5 cycles of latency, two FMA
// pipes: 10 chains keep them busy; tile_fma's 4 rows have 8 accumulators and decode each
// weight vector again for every 4 rows). The first pass of rows decodes the tile's bfloat16
// weights in registers as tile_fma does and writes the panel as it goes, so the widening
// costs a store per weight vector rather than a pass of its own, and the passes split the
// rows evenly (with a pass of widening of its own and 6, 6, 4 rows, the model's linears took
// 3-6% longer at 16 rows and 1-3% at 64, three alternating rounds on a 2-core Zen 2). The
// widening is exact, so the sums are the same products as tile_fma's, in the same order: the
// paths give the same bits.
constexpr int64_t kPanelRows = 6;
// From this many rows on, steps take the panel; fewer rows keep tile_fma, whose weights are
// decoded in registers for a pass or two rather than written and read back.
constexpr int64_t kPanelMinRows = 16;

// The first pass of rows over tile t: the bfloat16 weights decoded in registers, each k's
// two float32 vectors also stored to the panel (panel[k * 16 + i] = w[n0 + i, k]) for the
// passes after it. `next`: a later tile's bfloat16 weights (K * 32 bytes), asked into L2 as
// this pass runs, a line per pair of k (or none). avx2_tiles asks for the tile after next: in
// a step's layers, whose weights come from memory, that took the linears from 25.0 s to
// 23.4 s of a 64-stream run (the next tile alone: its fetch outlasts one pass).
template <int64_t R>
void widening_fma(const Bf16Weight& w, int64_t t, float* panel, const float* x,
                  Bf16Out y, const char* next) {
  const c10::BFloat16* tile = w.tile(t);
  // Each row's start once, so the loop indexes them with k alone (with x + r * w.K in it,
  // GCC reloaded w.K and rebuilt six addresses for every k).
  const float* xr[R];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) xr[r] = x + r * w.K;
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t pairs = w.K / 2;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    if (next != nullptr) _mm_prefetch(next + pair * 64, _MM_HINT_T1);
    const auto* line = reinterpret_cast<const __m256i*>(tile + pair * 2 * Bf16Weight::kTile);
    float* even = panel + 2 * pair * Bf16Weight::kTile;
    // k = 2 pair, then k + 1; each weight vector is loaded again for the odd k (from L1)
    // rather than held, and the odd k's weights are shifted down and back up rather than
    // masked, so that the 12 accumulators, two weight vectors and a broadcast fit the 16
    // registers with no constant (spilled accumulators cost more than the extra shift).
    for (int parity = 0; parity < 2; ++parity) {
      __m256 b[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(line + h);
        b[h] = _mm256_castsi256_ps(
            _mm256_slli_epi32(parity == 0 ? v : _mm256_srli_epi32(v, 16), 16));
        _mm256_storeu_ps(even + parity * Bf16Weight::kTile + 8 * h, b[h]);
      }
#pragma GCC unroll 6
      for (int64_t r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(xr[r] + 2 * pair + parity);
        acc[r][0] = _mm256_fmadd_ps(b[0], a, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(b[1], a, acc[r][1]);
      }
    }
  }
  store_tile_rows<R>(w, t, acc, y);
}

// A later pass of rows over the tile's panel.
template <int64_t R>
void panel_fma(const Bf16Weight& w, int64_t t, const float* panel, const float* x,
               Bf16Out y) {
  const float* xr[R];  // as widening_fma
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) xr[r] = x + r * w.K;
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t K = w.K;
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * Bf16Weight::kTile);
    const __m256 b1 = _mm256_loadu_ps(panel + k * Bf16Weight::kTile + 8);
#pragma GCC unroll 6
    for (int64_t r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xr[r] + k);
      acc[r][0] = _mm256_fmadd_ps(b0, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b1, a, acc[r][1]);
    }
  }
  store_tile_rows<R>(w, t, acc, y);
}

// One pass of `rows` (1..kPanelRows) rows over tile t: the first widens the tile into the
// panel, the others read it.
void panel_pass(const Bf16Weight& w, int64_t t, float* panel, const float* x, int64_t rows,
                Bf16Out y, bool first, const char* next) {
#define PAGEDSERVE_PANEL_PASS(R)                                         \
  case R:                                                                \
    return first ? widening_fma<R>(w, t, panel, x, y, next)              \
                 : panel_fma<R>(w, t, panel, x, y);
  switch (rows) {
    PAGEDSERVE_PANEL_PASS(6)
    PAGEDSERVE_PANEL_PASS(5)
    PAGEDSERVE_PANEL_PASS(4)
    PAGEDSERVE_PANEL_PASS(3)
    PAGEDSERVE_PANEL_PASS(2)
    default:
      return first ? widening_fma<1>(w, t, panel, x, y, next) : panel_fma<1>(w, t, panel, x, y);
  }
#undef PAGEDSERVE_PANEL_PASS
}

// Tile-major, as the dot-product kernel: a tile's weights (K * 32 bytes, or its panel's
// K * 64) stay in the cache for every pass of rows.
void avx2_tiles(const Bf16Weight& w, const c10::BFloat16* x, int64_t M, Bf16Out y,
                TileClaims& claims) {
  // Per thread, kept between calls: this runs for every linear layer of every step.
  thread_local std::vector<float> xf;
  xf.resize(M * w.K);
  for (int64_t i = 0; i < M * w.K; ++i) xf[i] = static_cast<float>(x[i]);
  const bool panels = M >= kPanelMinRows;
  thread_local std::vector<float> panel;
  if (panels) panel.resize(w.K * Bf16Weight::kTile);
  // The panel's passes split the rows evenly, at most kPanelRows each (16 rows: 6, 5, 5, not
  // 6, 6, 4, whose 8 accumulators would leave the FMA pipes waiting).
  const int64_t passes = (M + kPanelRows - 1) / kPanelRows;
  for (int64_t begin, end; claims.claim(begin, end);) {
    for (int64_t t = begin; t < end; ++t) {
      if (panels) {
        // The first pass asks for the tile after next of the run, if there is one.
        const char* next = t + 2 < end ? reinterpret_cast<const char*>(w.tile(t + 2)) : nullptr;
        for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
          const int64_t rows = M / passes + (pass < M % passes ? 1 : 0);
          panel_pass(w, t, panel.data(), xf.data() + r0 * w.K, rows, y.at(r0 * w.N), pass == 0,
                     next);
          r0 += rows;
        }
        continue;
      }
      for (int64_t r0 = 0; r0 < M; r0 += kFmaRows) {
        tile_rows_fma(w, t, xf.data() + r0 * w.K, std::min(kFmaRows, M - r0), y.at(r0 * w.N));
      }
    }
  }
}
