// The seam between the op entry points and the kernels.
//
// The entry points (attention_ops.cpp, elementwise_ops.cpp, dispatch.cpp) are compiled for
// the baseline CPU of the target (x86-64 or aarch64). The kernels (attention_kernels.cpp,
// elementwise_kernels.cpp) are compiled once per instruction set, each time with that
// set's -m flags and -DPAGEDSERVE_ISA=<namespace>, so every function of ours exists once
// per instruction set under its own name:
//
//   pagedserve::isa_portable::...      baseline flags           every CPU
//   pagedserve::isa_avx2::...          + AVX2, FMA, F16C        x86-64 only
//   pagedserve::isa_avx512::...        + AVX-512 F/BW/VL/DQ     x86-64 only
//   pagedserve::isa_avx512_bf16::...   + AVX512_BF16            x86-64 only
//
// dispatch.cpp picks one set from the CPU's features at run time (one binary for every
// CPU). The build links the baseline objects first and the others in the order above, so
// an inline function of a shared header (std::, c10::) that the linker merges keeps the
// copy of the smallest set that has one, which every caller's CPU can run.
//
// The baseline set is always built; each extra one only where setup.py defines its macro,
// PAGEDSERVE_WITH_ISA_AVX2, _AVX512 or _AVX512_BF16 (all of them by default on x86-64; a
// subset with PAGEDSERVE_CPU_ISAS), so the declarations below and dispatch.cpp's table
// name exactly the sets linked.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// For the vector primitives and the small kernels built on them: GCC leaves some out of
// line otherwise (exp8 was a call per score vector, 5% of a prefill).
#define PAGEDSERVE_INLINE inline __attribute__((always_inline))

namespace pagedserve {

// Keys per online-softmax step: W-lane vectors of scores, kChunk / W of them. Each step
// pays horizontal max and sum reductions and a rescale per query vector; 32 keys halve
// them against 16. In benchmarks/attention_cpu.py (2 threads, Zen 5, SmolLM2's 9/3 heads,
// caches warm, two alternating rounds) the AVX512-BF16 kernels took 18% less time on 64
// decodes of ~260 keys, 29% less on a 512-token prefill and 28% less on 32 decodes beside
// a 256-token chunk; the AVX-512 ones 9% and 7% less on the last two, the AVX2 ones 4% and
// 2%, while their decodes took 3-4% more, and the portable ones moved within 6% either way.
constexpr int kChunk = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct Problem {
  const T* q;  // (num_tokens, num_heads, head_dim), token stride q_stride
  const T* k_cache;  // (num_blocks, block_size, num_kv_heads, head_dim), contiguous
  const T* v_cache;
  T* out;  // like q, token stride out_stride
  int64_t q_stride, out_stride;
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;
  int64_t num_kv_heads, head_dim, block_size, group;
  float scale;
  // Online-softmax states that shared-prefix items save and the items after them resume
  // (attention_ops.cpp): per (token, head), acc[head_dim] then the running max and sum.
  float* state;
  // The states of the long decodes' parts (WorkItem::part), which attention_ops.cpp
  // merges: per (split decode, head, part), laid out like `state`.
  float* parts = nullptr;
  // A sliding window of this many keys (0: none): the query at position p sees only keys
  // p - window + 1..p, as transformers' sliding_window (kv_idx > q_idx - window).
  int64_t window = 0;
  // Attention sinks (gpt-oss), one logit per query head, or none: each head's softmax
  // denominator gains exp(sink), on the scale of the scaled scores.
  const float* sinks = nullptr;
};

// Parts a long decode's keys may be split into (WorkItem::part).
constexpr int64_t kMaxParts = 8;

// Query rows row_begin..row_end (from the request's first row) for the `group` query heads
// of one KV head, over keys key_begin..: the keys before key_begin were seen by a
// shared-prefix item, whose saved states the item resumes.
//
// A shared-prefix item (shared_keys > 0) is instead keys 0..shared_keys of request req's
// pages, which the requests whose rows it holds all share and all see in full (its rows
// may run on into the following requests' rows); it saves its states rather than writing
// outputs.
//
// An item may cover kv_heads consecutive KV heads from kv_head (a decode's, whose few query
// rows are cheap next to reading the keys): a key's rows of all those heads lie side by
// side in the cache, so reading them together streams each page once. Kernels without a
// path for that run the heads one after the other.
//
// A part (part >= 0) is keys key_begin..key_end of a long decode, whose keys are split so
// that its few KV heads keep more threads busy: it starts fresh and saves its states in
// Problem::parts, and the parts are merged after every item has run.
struct WorkItem {
  int32_t req, kv_head, row_begin, row_end;
  int32_t key_begin = 0, shared_keys = 0;
  int32_t kv_heads = 1;
  int32_t part = -1, key_end = 0, split = 0;  // split: the decode's index among the split
  int64_t cost = 0;
};

// Scratch owned by one thread for all the items it runs, kept between calls.
struct Scratch {
  // The item the thread runs after the current one (nullptr: none known): the current
  // one's last chunk requests its first keys (attention_item.h).
  const WorkItem* next = nullptr;
  std::vector<float> q, acc, p, k, kt, v, row_max, row_sum, alpha;
  std::vector<uint16_t> p16;
  std::vector<const void*> q_rows;
  // Grows the buffers to hold max_queries query vectors of head_dim, and a chunk's keys
  // and values for kv_heads heads; never shrinks them.
  void reserve(int64_t max_queries, int64_t head_dim, int64_t kv_heads) {
    if (max_queries <= max_queries_ && head_dim <= head_dim_ && kv_heads <= kv_heads_) return;
    max_queries_ = std::max(max_queries, max_queries_);
    head_dim_ = std::max(head_dim, head_dim_);
    kv_heads_ = std::max(kv_heads, kv_heads_);
    const int64_t m = max_queries_, d = head_dim_;
    for (auto* buf : {&q, &acc}) buf->resize(m * d);
    for (auto* buf : {&k, &v}) buf->resize(kChunk * d * kv_heads_);
    kt.resize(kChunk * d);
    for (auto* buf : {&row_max, &row_sum, &alpha}) buf->resize(m);
    p.resize(m * kChunk);
    p16.resize(m * kChunk);
    q_rows.resize(m);
  }

 private:
  int64_t max_queries_ = 0, head_dim_ = 0, kv_heads_ = 0;
};

// Rows of out = rms_norm(x [+ residual]) * weight; with a residual, x + residual is also
// written back to residual.
template <typename T>
struct RmsNormRows {
  T* out;
  int64_t out_stride;
  T* x;
  int64_t x_stride;
  T* residual;  // null: no residual add
  int64_t residual_stride;
  const T* weight;
  int64_t hidden;
  float eps;
};

// Tokens of q (T, q_heads, head_dim) and k (T, k_heads, head_dim), rotated in place.
template <typename T>
struct RopeRows {
  T* q;
  int64_t q_stride, q_heads;
  T* k;
  int64_t k_stride, k_heads;
  const T* cos;  // (T, head_dim)
  const T* sin;
  int64_t head_dim;
};

// Rows of out (T, I) = silu(gate) * up with gate_up = [gate | up] (T, 2 * I).
template <typename T>
struct SiluAndMulRows {
  T* out;
  int64_t out_stride;
  const T* gate_up;
  int64_t gate_up_stride;
  int64_t intermediate;
};

// A weight-only quantized linear layer's weight, tiled (quant_kernels.cpp has the layout):
// 16 output rows per tile, blocks of 32 weights along K, float16 scales (and mins) per
// group of `group` weights.
struct QuantWeight {
  const uint8_t* q;     // 4-bit: (tiles, K/32, 4, 16, 4) bytes; 8-bit: (tiles, K/32, 32, 16)
  const c10::Half* d;   // (tiles, K / group, 16)
  const c10::Half* m;   // (tiles, K / group, 16), 4-bit only
  int64_t N, K, group;
  int bits;

  static constexpr int64_t kTile = 16;
  static constexpr int64_t kBlock = 32;
  int64_t tiles() const { return (N + kTile - 1) / kTile; }
  int64_t blocks() const { return K / kBlock; }
  int64_t groups() const { return K / group; }
  int64_t block_bytes() const { return bits == 4 ? kTile * kBlock / 2 : kTile * kBlock; }
  const uint8_t* block(int64_t t, int64_t b) const {
    return q + (t * blocks() + b) * block_bytes();
  }
  // The integer of weight (n, k): q in 0..15 (4 bits) or -128..127 (8 bits).
  int value(int64_t n, int64_t k) const {
    const int64_t row = n % kTile, kk = k % kBlock;
    const uint8_t* blk = block(n / kTile, k / kBlock);
    if (bits == 8) return static_cast<int8_t>(blk[kk * kTile + row]);
    return octet_value(octet_word(blk, kk / 8, row), kk % 8);
  }
  // Row `row`'s 32-bit word of a 4-bit block's octet (little-endian), and its integer at
  // k = 8 octet + j: bits 4 (j / 2) + 16 (j % 2) (quant_kernels.cpp has the layout).
  static uint32_t octet_word(const uint8_t* blk, int64_t octet, int64_t row) {
    uint32_t word;
    std::memcpy(&word, blk + octet * 4 * kTile + 4 * row, sizeof(word));
    return word;
  }
  static int octet_value(uint32_t word, int64_t j) {
    return static_cast<int>((word >> (4 * (j / 2) + 16 * (j % 2))) & 0x0F);
  }
  // The 32 integers of row n in block b, k ascending: value(n, 32 b + i) for each i, read
  // a word (4 bits) or a byte (8 bits) at a time.
  void block_values(int64_t n, int64_t b, int* out) const {
    const int64_t row = n % kTile;
    const uint8_t* blk = block(n / kTile, b);
    if (bits == 8) {
      for (int64_t kk = 0; kk < kBlock; ++kk) out[kk] = static_cast<int8_t>(blk[kk * kTile + row]);
      return;
    }
    for (int64_t octet = 0; octet < kBlock / 8; ++octet) {
      const uint32_t word = octet_word(blk, octet, row);
      for (int64_t j = 0; j < 8; ++j) out[8 * octet + j] = octet_value(word, j);
    }
  }
  float scale(int64_t n, int64_t g) const {
    return static_cast<float>(d[(n / kTile * groups() + g) * kTile + n % kTile]);
  }
  float min(int64_t n, int64_t g) const {
    return static_cast<float>(m[(n / kTile * groups() + g) * kTile + n % kTile]);
  }
};

// Up to 8 rows of a quantized linear's input: float32 copies, their group sums, and the
// bfloat16 originals when the input is bfloat16 (null otherwise). For the AVX2 set and
// bfloat16 input, also the rows as int16 with a power-of-two scale per block of 32 (null
// otherwise): x = xq * xq_scale, exact for every bfloat16 value within 2^7 of its block's
// largest (quant_ops.cpp explains the rest).
struct QuantRows {
  const float* x;             // (count, K)
  const c10::BFloat16* xb;    // (count, K) or null
  const float* xsum;          // (count, K / group)
  int64_t count;
  const int16_t* xq = nullptr;       // (count, K) or null
  const float* xq_scale = nullptr;   // (count, K / 32) or null
};

// Where those rows' outputs go: row r at float32 or bfloat16 `data` + r * N.
struct QuantOut {
  void* data;
  bool bf16;
  // float32 outputs that hold the bfloat16-rounded numbers (bf16 false): an LM head's
  // logits for bfloat16 rows, as .float() of the bfloat16 outputs would be.
  bool rounded = false;
};

// A linear layer's output tiles begin..end, claimed a run at a time by the threads of one
// parallel region (parallel.h says why). Each claim takes 1/(2 * threads) of what is left,
// at least min_chunk tiles: long runs first, then shorter ones that even out the threads'
// ends.
class TileClaims {
 public:
  TileClaims(int64_t begin, int64_t end, int64_t min_chunk, int64_t threads)
      : next_(begin), end_(end), min_chunk_(std::max<int64_t>(1, min_chunk)),
        divisor_(2 * std::max<int64_t>(1, threads)) {}

  // The next run [begin, stop); false when every tile is claimed.
  bool claim(int64_t& begin, int64_t& stop) {
    int64_t next = next_.load(std::memory_order_relaxed);
    while (next < end_) {
      const int64_t size = std::max(min_chunk_, (end_ - next) / divisor_);
      if (next_.compare_exchange_weak(next, next + size, std::memory_order_relaxed)) {
        begin = next;
        stop = std::min(next + size, end_);
        return true;
      }
    }
    return false;
  }

 private:
  std::atomic<int64_t> next_;
  const int64_t end_, min_chunk_, divisor_;
};

// A bfloat16 linear layer's weight tiled for the dot-product instructions
// (bf16_linear_kernels.cpp has the layout): (tiles, K/2, 16, 2), for each tile of 16 output
// rows and each pair of k, the 16 rows' weights at k and k + 1. N is padded to whole tiles.
struct Bf16Weight {
  const c10::BFloat16* w;
  int64_t N, K;
  static constexpr int64_t kTile = 16;
  int64_t tiles() const { return (N + kTile - 1) / kTile; }
  const c10::BFloat16* tile(int64_t t) const { return w + t * K * kTile; }
  float value(int64_t n, int64_t k) const {
    return static_cast<float>(tile(n / kTile)[(k / 2) * 2 * kTile + (n % kTile) * 2 + k % 2]);
  }
};

// Where a bfloat16 linear layer's outputs go: bfloat16, or float32 holding the same rounded
// values (an LM head's logits, as bf16_linear(...).float() would give them, without the
// bfloat16 copy).
struct Bf16Out {
  void* data;
  bool f32 = false;
  // Whole tiles go straight to memory (non-temporal stores; 64-byte aligned rows): an
  // output too large for the caches, read once by its consumer (bf16_linear says when).
  bool stream = false;
  // The output `elements` further on.
  Bf16Out at(int64_t elements) const {
    return {static_cast<char*>(data) + elements * (f32 ? 4 : 2), f32, stream};
  }
  // Output i as the bfloat16 number `bits`.
  void put(int64_t i, uint16_t bits) const {
    if (f32) {
      const uint32_t wide = uint32_t{bits} << 16;
      std::memcpy(static_cast<float*>(data) + i, &wide, sizeof(wide));
    } else {
      static_cast<uint16_t*>(data)[i] = bits;
    }
  }
};

// Rows of y (T, N) += (x (T, K) A_slot^T) Bt_slot, each run of rows with its own slot: the
// LoRA adapters of a step (engine/models/lora_layers.py has the layout). A slot's A (R, K) and
// Bt (R, N) hold `blocks` blocks of R / blocks rows, of which the first ranks[slot] are the
// adapter's (the rest are zero and skipped); block b's rows of Bt are zero outside columns
// col_offsets[b]..col_offsets[b + 1] (its output slice), which alone are read.
template <typename T>
struct LoRARows {
  T* y;
  int64_t y_stride;
  const T* x;
  int64_t x_stride;
  const T* a;   // (slots, R, K), contiguous
  const T* bt;  // (slots, R, N), contiguous
  int64_t K, N, R, blocks;
  const int64_t* ranks;        // per slot
  const int64_t* col_offsets;  // blocks + 1
  // Work items: up to kLoRARowsPerItem consecutive rows from item_rows[i] of one slot.
  const int64_t* item_rows;
  const int64_t* item_counts;
  const int64_t* item_slots;
};
constexpr int64_t kLoRARowsPerItem = 4;

// One instruction set's kernels for element type T. The row kernels cover rows
// begin..end, so the caller's thread pool splits the work.
template <typename T>
struct KernelsFor {
  void (*attention_item)(const Problem<T>&, const WorkItem&, Scratch&);
  void (*rms_norm_rows)(const RmsNormRows<T>&, int64_t begin, int64_t end);
  void (*rope_rows)(const RopeRows<T>&, int64_t begin, int64_t end);
  void (*silu_and_mul_rows)(const SiluAndMulRows<T>&, int64_t begin, int64_t end);
  // LoRARows work items begin..end.
  void (*lora_rows)(const LoRARows<T>&, int64_t begin, int64_t end);
};

struct Kernels {
  const char* isa;
  KernelsFor<float> f32;
  KernelsFor<c10::BFloat16> bf16;
  KernelsFor<c10::Half> f16;
  // Quantized linear: tiles begin..end of y for `rows`.
  void (*quant_tiles)(const QuantWeight&, const QuantRows&, QuantOut, int64_t begin,
                      int64_t end);
  // QuantRows::xq and xq_scale for the M rows of float32 x (M, K), which only the AVX2 set's
  // tiles read: every set has it, and gives the same integers and scales.
  void (*quant_rows_int16)(const float* x, int64_t M, int64_t K, int16_t* xq, float* scale);
  // bfloat16 linear: the tiles of y (M, N) = x (M, K) W^T that this thread claims, every
  // row of x.
  void (*bf16_tiles)(const Bf16Weight&, const c10::BFloat16* x, int64_t M, Bf16Out y,
                     TileClaims& claims);
  // The bfloat16 LM head's int8 screen: out (M, rows) int32 = the M rows of x (M, K) int16
  // times q (rows, K) int8, K a multiple of 32; exact integer sums, the same in every set
  // (the caller keeps them within int32).
  void (*int8_row_dots)(const int8_t* q, int64_t K, const int16_t* x, int64_t M, int64_t rows,
                        int32_t* out);

  template <typename T>
  const KernelsFor<T>& of() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16;
    else return f16;
  }
};

// Calls f(T{}) for the element type T of a float32, bfloat16 or float16 tensor.
template <typename F>
void dispatch_dtype(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::kFloat: return f(float{});
    case c10::kBFloat16: return f(c10::BFloat16{});
    case c10::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

// The kernels the ops run: those this CPU runs best (chosen once, from its features), or
// the set the op select_cpu_isa picked (dispatch.cpp).
const Kernels& active_kernels();

// The kernels of the named instruction set; raises (TORCH_CHECK) when this build lacks
// them or this CPU cannot run them.
const Kernels& kernels_named(const std::string& isa);

// The kernels the op's optional `isa` argument asks for (tests); the active ones for None.
inline const Kernels& kernels_for(const std::optional<std::string>& isa) {
  return isa ? kernels_named(*isa) : active_kernels();
}

}  // namespace pagedserve

// Each instruction set's definitions, for dispatch.cpp. attention_kernels.cpp and
// elementwise_kernels.cpp define them (explicitly instantiated for float, BFloat16, Half).
#define PAGEDSERVE_DECLARE_KERNELS(ns)                                                   \
  namespace pagedserve::ns {                                                              \
  template <typename T>                                                                   \
  void attention_item(const Problem<T>& pb, const WorkItem& item, Scratch& scratch);     \
  template <typename T>                                                                   \
  void rms_norm_rows(const RmsNormRows<T>& a, int64_t begin, int64_t end);               \
  template <typename T>                                                                   \
  void rope_rows(const RopeRows<T>& a, int64_t begin, int64_t end);                      \
  template <typename T>                                                                   \
  void silu_and_mul_rows(const SiluAndMulRows<T>& a, int64_t begin, int64_t end);        \
  template <typename T>                                                                   \
  void lora_rows(const LoRARows<T>& a, int64_t begin, int64_t end);                      \
  void quant_tiles(const QuantWeight& w, const QuantRows& rows, QuantOut out,            \
                   int64_t begin, int64_t end);                                           \
  void quant_rows_int16(const float* x, int64_t M, int64_t K, int16_t* xq, float* scale); \
  void bf16_tiles(const Bf16Weight& w, const c10::BFloat16* x, int64_t M, Bf16Out y,         \
                  TileClaims& claims);                                                    \
  void int8_row_dots(const int8_t* q, int64_t K, const int16_t* x, int64_t M,             \
                     int64_t rows, int32_t* out);                                          \
  }

#if defined(PAGEDSERVE_WITH_ISA_AVX2) || defined(PAGEDSERVE_WITH_ISA_AVX512) || \
    defined(PAGEDSERVE_WITH_ISA_AVX512_BF16)
#ifndef __x86_64__
#error "the AVX sets are x86-64 only (setup.py builds the portable set alone elsewhere)"
#endif
#endif

PAGEDSERVE_DECLARE_KERNELS(isa_portable)
#ifdef PAGEDSERVE_WITH_ISA_AVX2
PAGEDSERVE_DECLARE_KERNELS(isa_avx2)
#endif
#ifdef PAGEDSERVE_WITH_ISA_AVX512
PAGEDSERVE_DECLARE_KERNELS(isa_avx512)
#endif
#ifdef PAGEDSERVE_WITH_ISA_AVX512_BF16
PAGEDSERVE_DECLARE_KERNELS(isa_avx512_bf16)
#endif
