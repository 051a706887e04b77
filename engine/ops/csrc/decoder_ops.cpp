// A Llama-family model's decoder layers on the CPU in a single op call.
//
// engine/models/llama.py runs a layer as some fifty small torch calls from Python (norms,
// three linears and a fourth, views, the rotary embedding, the K/V write, attention, SiLU),
// and each call's Python-side dispatch costs a few microseconds: at one token per step,
// that overhead rivals the arithmetic. This op makes the same calls, to the same kernels
// with the same tensors, from C++: the results are bit-identical to the Python layer (the
// tests check), only the dispatch is gone. The layer's weights travel as a TorchScript
// class, built once per layer when the model is loaded (engine/models/fused_layers.py), and
// one op call runs every layer (a call from Python costs about 27 us to cross into C++).
//
// It runs the cpu-native attention backend's computation (the K/V write through the slot
// mapping, then paged attention over the CSR page table); other backends keep the Python
// layer.
//
// A layer's MLP is dense (gate_up, SiLU-and-mul, down) or a sparse mixture of experts,
// which moe_ops.cpp runs as SparseMoE.forward does.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "layer_weights.h"

namespace pagedserve {
namespace {

// The wall time the layers spend in their linears and attention, while asked for
// (kernel_time_ns): how much of a real step its kernels take, in place, with the caches as
// the step leaves them (benchmarks/decode_breakdown.py), and how much of it is attention.
// Off, it costs one relaxed load.
std::atomic<bool> g_time_kernels{false};
std::atomic<int64_t> g_kernel_ns{0}, g_attention_ns{0};

class KernelTimer {
 public:
  explicit KernelTimer(std::atomic<int64_t>* also = nullptr)
      : on_(g_time_kernels.load(std::memory_order_relaxed)), also_(also) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~KernelTimer() {
    if (!on_) return;
    const auto spent = std::chrono::steady_clock::now() - start_;
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(spent).count();
    g_kernel_ns += ns;
    if (also_ != nullptr) *also_ += ns;
  }

 private:
  bool on_;
  std::atomic<int64_t>* also_;
  std::chrono::steady_clock::time_point start_;
};

// Starts (or stops) the count; returns the nanoseconds counted since the last call: all
// the kernels', and attention's alone.
std::tuple<int64_t, int64_t> kernel_time_ns(bool enable) {
  g_time_kernels = enable;
  return {g_kernel_ns.exchange(0), g_attention_ns.exchange(0)};
}

// The step's LoRA segments (decoder_layers' lora_bounds and lora_slots) while its layers
// run; empty when no row of the step has an adapter.
thread_local std::vector<int64_t> t_lora_bounds, t_lora_slots;

struct LayerWeights : torch::CustomClassHolder {
  c10::intrusive_ptr<LinearWeights> qkv, o_proj;
  // The MLP: dense (gate_up and down) or sparse (moe).
  c10::intrusive_ptr<LinearWeights> gate_up, down;
  c10::intrusive_ptr<MoeWeights> moe;
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3
  double eps;
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t window;  // the layer's sliding window in keys (0: none)

  LayerWeights(c10::intrusive_ptr<LinearWeights> qkv, c10::intrusive_ptr<LinearWeights> o_proj,
               std::optional<c10::intrusive_ptr<LinearWeights>> gate_up,
               std::optional<c10::intrusive_ptr<LinearWeights>> down,
               std::optional<c10::intrusive_ptr<MoeWeights>> moe, at::Tensor input_norm,
               at::Tensor post_norm, std::optional<at::Tensor> q_norm,
               std::optional<at::Tensor> k_norm, double eps, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t window)
      : qkv(std::move(qkv)), o_proj(std::move(o_proj)), input_norm(std::move(input_norm)),
        post_norm(std::move(post_norm)), q_norm(std::move(q_norm)), k_norm(std::move(k_norm)),
        eps(eps), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim),
        window(window) {
    TORCH_CHECK(moe.has_value() != (gate_up.has_value() && down.has_value()) &&
                    gate_up.has_value() == down.has_value(),
                "a layer's MLP is either dense (gate_up and down) or sparse (moe)");
    if (moe.has_value()) this->moe = std::move(*moe);
    if (gate_up.has_value()) this->gate_up = std::move(*gate_up);
    if (down.has_value()) this->down = std::move(*down);
  }
};

// A model's layers in order, for decoder_layers: built once at load time. With its ends
// (set_ends), the whole model for decoder_model: the token embedding before the layers
// (a dense table, or a quantized one that is dequantized row by row) and the final
// RMSNorm after them.
struct DecoderStack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<LayerWeights>> layers;
  c10::intrusive_ptr<LinearWeights> embed;  // kDense (V, H) or kQuantized; unset: no ends
  at::Tensor final_norm;
  double final_eps = 0.0;

  void append(c10::intrusive_ptr<LayerWeights> layer) { layers.push_back(std::move(layer)); }

  void set_ends(c10::intrusive_ptr<LinearWeights> embedding, at::Tensor norm, double eps) {
    TORCH_CHECK(embedding->kind == kDense || embedding->kind == kQuantized,
                "a stack's embedding is a dense or a quantized table");
    embed = std::move(embedding);
    final_norm = std::move(norm);
    final_eps = eps;
  }

  bool has_ends() const { return static_cast<bool>(embed); }
};

// Our own ops, called through the dispatcher (their implementations live in other files).
const auto& rms_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::rms_norm", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                      const OptString&)>();
  return op;
}

const auto& fused_add_rms_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::fused_add_rms_norm", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                      const OptString&)>();
  return op;
}

const auto& rotary_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::rotary_embedding", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const OptString&)>();
  return op;
}

const auto& silu_and_mul_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::silu_and_mul", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const OptString&)>();
  return op;
}

const auto& paged_attention_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::paged_attention", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, double, const OptString&,
                      int64_t, const std::optional<at::Tensor>&)>();
  return op;
}

const auto& quant_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::quant_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                            const OptString&, std::optional<at::ScalarType>)>();
  return op;
}

const auto& quant_dequantize_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::quant_dequantize", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            int64_t, int64_t, int64_t, const std::optional<at::Tensor>&,
                            at::ScalarType)>();
  return op;
}

const auto& lora_apply_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::lora_apply", "")
          .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                      const OptString&)>();
  return op;
}

const auto& bf16_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pagedserve::bf16_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptString&,
                            std::optional<at::ScalarType>)>();
  return op;
}

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), as layers.py calls it.
at::Tensor packed_linear(const at::Tensor& x, const LinearWeights& w) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w.weight);
  stack.emplace_back(w.bias.has_value() ? c10::IValue(*w.bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

namespace {

// layers.Linear.forward's base output for 2-D x: the same kernels and the same tensors.
at::Tensor base_linear(const at::Tensor& x, const LinearWeights& w, const OptString& isa) {
  if (w.dense_copy && x.size(0) > w.dense_rows) return base_linear(x, *w.dense_copy, isa);
  const KernelTimer timer;
  if (w.kind == kPacked) return packed_linear(x, w);
  if (w.kind == kDense) return at::linear(x, w.weight, w.bias);
  at::Tensor y;
  if (w.kind == kTiled) {
    y = bf16_linear_op().call(x, w.weight, w.n, isa, std::nullopt);
  } else if (x.size(0) <= w.max_kernel_rows) {
    y = quant_linear_op().call(x, w.weight, *w.scales, w.mins, w.bits, w.group_size, w.n, isa,
                              std::nullopt);
  } else {
    const at::Tensor dense = quant_dequantize_op().call(w.weight, *w.scales, w.mins, w.bits,
                                                        w.group_size, w.n, std::nullopt,
                                                        x.scalar_type());
    y = at::linear(x, dense);
  }
  return w.bias.has_value() ? y + *w.bias : y;
}

}  // namespace

// The base layer's output, plus the step's LoRA adapters where the layer has slots (set
// by decoder_layers while its layers run).
at::Tensor linear(const at::Tensor& x, const LinearWeights& w, const OptString& isa) {
  at::Tensor y = base_linear(x, w, isa);
  if (w.lora_a.has_value() && !t_lora_slots.empty()) {
    const KernelTimer timer;
    lora_apply_op().call(y, x, *w.lora_a, *w.lora_bt, *w.lora_ranks, w.lora_col_offsets,
                         t_lora_bounds, t_lora_slots, isa);
  }
  return y;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up, const OptString& isa) {
  at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_op().call(act, gate_up, isa);
  return act;
}

namespace {

// native_ops.rms_norm on (..., H): a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty_like(rows);
  rms_norm_op().call(out, rows, weight, eps, std::nullopt);
  return out.view(x.sizes());
}

// write_kv (engine/attention/backend.py): this step's K and V into their slots of the
// layer's caches, as index_copy_ does, but as one copy per token's (kv_heads, D) row: two
// index_copy_ calls cost about 20 us a layer in TensorIterator's setup alone, half a
// millisecond of a decode step. Other layouts keep index_copy_.
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const bool rows = k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                    v.stride(1) == v.size(2) && v.sizes() == k.sizes() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k.scalar_type() == k_cache.scalar_type() &&
                    v.scalar_type() == v_cache.scalar_type() && slots.is_contiguous() &&
                    slots.scalar_type() == at::kLong && slots.numel() == T;
  if (!rows) {
    k_cache.view({-1, k.size(1), k.size(2)}).index_copy_(0, slots, k);
    v_cache.view({-1, v.size(1), v.size(2)}).index_copy_(0, slots, v);
    return;
  }
  const int64_t num_slots = k_cache.numel() / row;
  const size_t bytes = row * k.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t],
                " is outside the cache's ", num_slots, " slots");
    std::memcpy(kc + slot[t] * bytes, kp + t * k_step, bytes);
    std::memcpy(vc + slot[t] * bytes, vp + t * v_step, bytes);
  }
}

// Attention.forward with the cpu-native backend: q, k, v views of the qkv buffer.
at::Tensor attention(const LayerWeights& w, const at::Tensor& h, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& qo_indptr,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                     const at::Tensor& kv_last_page_len, double scale) {
  const int64_t T = h.size(0), D = w.head_dim;
  const int64_t q_size = w.num_heads * D, kv_size = w.num_kv_heads * D;
  const at::Tensor qkv = linear(h, *w.qkv);  // (T, q_size + 2 * kv_size)
  const auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
  at::Tensor q = parts[0].view({T, w.num_heads, D});
  at::Tensor k = parts[1].view({T, w.num_kv_heads, D});
  const at::Tensor v = parts[2].view({T, w.num_kv_heads, D});
  if (w.q_norm.has_value() && w.k_norm.has_value()) {
    q = rms_norm(q, *w.q_norm, w.eps);
    k = rms_norm(k, *w.k_norm, w.eps);
  }
  rotary_op().call(q, k, cos, sin, std::nullopt);  // in place (native_ops.apply_rope_)
  // This step's K/V into their slots, then attention over the paged history.
  write_kv(k_cache, v_cache, slot_mapping, k, v);
  if (q.stride(-1) != 1 || q.stride(-2) != D) q = q.contiguous();
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);  // (T, heads, D)
  {
    const KernelTimer timer(&g_attention_ns);
    paged_attention_op().call(out, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                              kv_last_page_len, scale, std::nullopt, w.window, std::nullopt);
  }
  return linear(out.reshape({T, q_size}), *w.o_proj);
}

// DecoderLayer.forward: (this layer's MLP output, the residual before it), the residual
// stream carried unsummed as in llama.py. x and residual are reused (mutated).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const c10::intrusive_ptr<LayerWeights>& weights, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
    const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len, double scale) {
  const LayerWeights& w = *weights;
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "decoder_layer: x must be a contiguous CPU (tokens, hidden) tensor");
  at::Tensor h, res;
  if (!residual.has_value()) {  // the first layer: x is the embeddings
    res = x;
    h = rms_norm(x, w.input_norm, w.eps);
  } else {
    TORCH_CHECK(residual->is_contiguous(), "decoder_layer: the residual must be contiguous");
    h = x;
    res = *residual;
    fused_add_rms_norm_op().call(h, res, w.input_norm, w.eps, std::nullopt);
  }
  at::Tensor attn = attention(w, h, cos, sin, k_cache, v_cache, slot_mapping, qo_indptr,
                              kv_indptr, kv_indices, kv_last_page_len, scale);
  fused_add_rms_norm_op().call(attn, res, w.post_norm, w.eps, std::nullopt);
  if (w.moe) return {sparse_moe(attn, w.moe, std::nullopt), res};
  const at::Tensor gate_up = linear(attn, *w.gate_up);  // (T, 2 * I)
  return {linear(silu_and_mul(gate_up), *w.down), res};
}

// Every layer of the stack in turn: one call from Python a step, not one a layer (a call
// with thirteen arguments crossed into C++ in about 27 us, 0.8 ms of a single-stream decode
// step over 30 layers). k_caches[i] and v_caches[i] are layer i's.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, const c10::intrusive_ptr<DecoderStack>& stack, const at::Tensor& cos,
    const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
    const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
    const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
    const at::Tensor& kv_last_page_len, double scale, at::IntArrayRef lora_bounds,
    at::IntArrayRef lora_slots) {
  const auto& layers = stack->layers;
  // The step's adapter segments, for linear() while this call runs (and no longer).
  struct LoRASegments {
    LoRASegments(at::IntArrayRef bounds, at::IntArrayRef slots) {
      t_lora_bounds.assign(bounds.begin(), bounds.end());
      t_lora_slots.assign(slots.begin(), slots.end());
    }
    ~LoRASegments() {
      t_lora_bounds.clear();
      t_lora_slots.clear();
    }
  } segments(lora_bounds, lora_slots);
  TORCH_CHECK(!layers.empty(), "decoder_layers: the stack has no layers");
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "decoder_layers: one K and one V cache a layer");
  at::Tensor hidden = x;
  std::optional<at::Tensor> residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto [out, res] = decoder_layer(hidden, residual, layers[i], cos, sin, k_caches[i],
                                    v_caches[i], slot_mapping, qo_indptr, kv_indptr,
                                    kv_indices, kv_last_page_len, scale);
    hidden = std::move(out);
    residual = std::move(res);
  }
  return {hidden, *residual};
}

// The rows of a 2-D table at `index`, as index_select (and so F.embedding, and the rotary
// tables' lookup) gives them, as one copy a row: at one token a step, index_select's own
// setup is most of its cost, and that setup's code and data are out of the caches by the
// time a step gets to it.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index) {
  if (table.dim() != 2 || !table.is_contiguous() || index.dim() != 1 ||
      !index.is_contiguous() || index.scalar_type() != at::kLong) {
    return table.index_select(0, index);
  }
  const int64_t T = index.size(0), rows = table.size(0);
  at::Tensor out = at::empty({T, table.size(1)}, table.options());
  const size_t bytes = table.size(1) * table.element_size();
  const int64_t* idx = index.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(table.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(idx[t] >= 0 && idx[t] < rows, "index ", idx[t], " is outside the table's ",
                rows, " rows");
    std::memcpy(dst + t * bytes, src + idx[t] * bytes, bytes);
  }
  return out;
}

// DecoderModel.forward on a stack with its ends, in one call: the embedding of input_ids,
// the rotary rows of `positions` (from RotaryEmbedding's tables, which must hold them),
// every layer, the final add and RMSNorm: the same ops on the same tensors as the Python
// around decoder_layers, whose few small calls a step, each a dispatch from Python, cost
// about 0.4 ms of a single-stream decode step once the weights have gone through the
// caches (benchmarks/cold_host_ops.py).
at::Tensor decoder_model(const at::Tensor& input_ids, const at::Tensor& positions,
                         const c10::intrusive_ptr<DecoderStack>& stack,
                         const at::Tensor& cos_table, const at::Tensor& sin_table,
                         const std::vector<at::Tensor>& k_caches,
                         const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                         const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                         double scale, at::IntArrayRef lora_bounds,
                         at::IntArrayRef lora_slots) {
  TORCH_CHECK(stack->has_ends(), "decoder_model: the stack has no embedding and final norm");
  TORCH_CHECK(input_ids.dim() == 1 && positions.dim() == 1 &&
                  input_ids.size(0) == positions.size(0),
              "decoder_model: one position per input id");
  const LinearWeights& e = *stack->embed;
  const at::Tensor x =
      e.kind == kDense
          ? gather_rows(e.weight, input_ids)
          : quant_dequantize_op().call(e.weight, *e.scales, e.mins, e.bits, e.group_size, e.n,
                                       input_ids, stack->final_norm.scalar_type());
  const at::Tensor cos = gather_rows(cos_table, positions).unsqueeze(1);
  const at::Tensor sin = gather_rows(sin_table, positions).unsqueeze(1);
  auto [hidden, residual] =
      decoder_layers(x.contiguous(), stack, cos, sin, k_caches, v_caches, slot_mapping,
                     qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale, lora_bounds,
                     lora_slots);
  fused_add_rms_norm_op().call(hidden, residual, stack->final_norm, stack->final_eps,
                               std::nullopt);
  return hidden;
}

}  // namespace
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.class_<pagedserve::LinearWeights>("LinearWeights")
      .def(torch::init<int64_t, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                       std::optional<at::Tensor>, int64_t, int64_t, int64_t, int64_t>())
      .def("set_dense_copy", &pagedserve::LinearWeights::set_dense_copy)
      .def("set_lora", &pagedserve::LinearWeights::set_lora);
  m.class_<pagedserve::MoeWeights>("MoeWeights")
      .def(torch::init<c10::intrusive_ptr<pagedserve::LinearWeights>, int64_t, bool>())
      .def("append", &pagedserve::MoeWeights::append);
  m.class_<pagedserve::LayerWeights>("LayerWeights")
      .def(torch::init<c10::intrusive_ptr<pagedserve::LinearWeights>,
                       c10::intrusive_ptr<pagedserve::LinearWeights>,
                       std::optional<c10::intrusive_ptr<pagedserve::LinearWeights>>,
                       std::optional<c10::intrusive_ptr<pagedserve::LinearWeights>>,
                       std::optional<c10::intrusive_ptr<pagedserve::MoeWeights>>, at::Tensor,
                       at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, double,
                       int64_t, int64_t, int64_t, int64_t>());
  m.class_<pagedserve::DecoderStack>("DecoderStack")
      .def(torch::init<>())
      .def("append", &pagedserve::DecoderStack::append)
      .def("set_ends", &pagedserve::DecoderStack::set_ends)
      .def("has_ends", &pagedserve::DecoderStack::has_ends);
  m.def(
      "decoder_layers(Tensor x, __torch__.torch.classes.pagedserve.DecoderStack stack, "
      "Tensor cos, Tensor sin, Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, "
      "Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, "
      "float scale, int[] lora_bounds=[], int[] lora_slots=[]) -> (Tensor, Tensor)");
  m.def(
      "decoder_model(Tensor input_ids, Tensor positions, "
      "__torch__.torch.classes.pagedserve.DecoderStack stack, Tensor cos_table, "
      "Tensor sin_table, Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, "
      "Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, "
      "float scale, int[] lora_bounds=[], int[] lora_slots=[]) -> Tensor");
  m.def("kernel_time_ns(bool enable) -> (int, int)", &pagedserve::kernel_time_ns);
  // moe_ops.cpp implements it; defined here, after the class it takes.
  m.def(
      "sparse_moe(Tensor x, __torch__.torch.classes.pagedserve.MoeWeights weights, "
      "str? isa=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("decoder_layers", &pagedserve::decoder_layers);
  m.impl("decoder_model", &pagedserve::decoder_model);
}
