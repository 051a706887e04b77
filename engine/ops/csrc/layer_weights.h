// The weights of a decoder's linear layers and sparse MLPs as TorchScript classes, built once
// at load time (engine/models/fused_layers.py), and the computations over them that more
// than one entry point runs: decoder_ops.cpp (the layers in one op) and moe_ops.cpp (a
// sparse mixture-of-experts MLP). decoder_ops.cpp registers the classes, so that each is
// known before a class or op that takes it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedserve {

using OptString = std::optional<std::string>;

// How a linear layer's weight is stored (engine/models/layers.py's Linear).
enum LinearKind : int64_t { kDense = 0, kPacked = 1, kQuantized = 2, kTiled = 3 };

struct LinearWeights : torch::CustomClassHolder {
  int64_t kind;
  at::Tensor weight;  // dense (N, K), oneDNN-packed, tiled quantized or tiled bfloat16
  std::optional<at::Tensor> bias;
  std::optional<at::Tensor> scales, mins;  // quantized only
  int64_t bits, group_size, n, max_kernel_rows;  // n: quantized and tiled bfloat16
  // A quantized layer's dense copy, which inputs of more than dense_rows rows run on, as
  // layers.Linear.forward picks (set_dense_copy; the decoder stack instead picks a whole
  // stack of dense copies by the step's size, and leaves this unset).
  c10::intrusive_ptr<LinearWeights> dense_copy;
  int64_t dense_rows = 0;

  LinearWeights(int64_t kind, at::Tensor weight, std::optional<at::Tensor> bias,
                std::optional<at::Tensor> scales, std::optional<at::Tensor> mins, int64_t bits,
                int64_t group_size, int64_t n, int64_t max_kernel_rows)
      : kind(kind), weight(std::move(weight)), bias(std::move(bias)), scales(std::move(scales)),
        mins(std::move(mins)), bits(bits), group_size(group_size), n(n),
        max_kernel_rows(max_kernel_rows) {
    TORCH_CHECK(kind >= kDense && kind <= kTiled, "unknown linear kind");
    TORCH_CHECK(kind != kQuantized || this->scales.has_value(), "quantized weights need scales");
  }

  // The layer's LoRA slots (engine/models/lora_layers.py's LoRASlots: the same tensors, which the
  // runner fills in place), added to the step's adapted rows after the base output.
  std::optional<at::Tensor> lora_a, lora_bt, lora_ranks;
  std::vector<int64_t> lora_col_offsets;

  void set_lora(at::Tensor a, at::Tensor bt, at::Tensor ranks, std::vector<int64_t> col_offsets) {
    lora_a = std::move(a);
    lora_bt = std::move(bt);
    lora_ranks = std::move(ranks);
    lora_col_offsets = std::move(col_offsets);
  }

  void set_dense_copy(c10::intrusive_ptr<LinearWeights> copy, int64_t rows) {
    TORCH_CHECK(kind == kQuantized && copy->kind != kQuantized,
                "a dense copy belongs to a quantized layer and is not quantized itself");
    dense_copy = std::move(copy);
    dense_rows = rows;
  }
};

// engine/models/moe.py's SparseMoE: the router, then each expert's fused gate/up and down
// projections (a SwiGLU MLP), in expert order.
struct MoeWeights : torch::CustomClassHolder {
  c10::intrusive_ptr<LinearWeights> router;
  std::vector<c10::intrusive_ptr<LinearWeights>> gate_up, down;
  int64_t top_k;
  bool norm_topk_prob;

  MoeWeights(c10::intrusive_ptr<LinearWeights> router, int64_t top_k, bool norm_topk_prob)
      : router(std::move(router)), top_k(top_k), norm_topk_prob(norm_topk_prob) {
    TORCH_CHECK(top_k > 0, "top_k must be positive");
  }

  void append(c10::intrusive_ptr<LinearWeights> expert_gate_up,
              c10::intrusive_ptr<LinearWeights> expert_down) {
    gate_up.push_back(std::move(expert_gate_up));
    down.push_back(std::move(expert_down));
  }

  int64_t num_experts() const { return static_cast<int64_t>(gate_up.size()); }
};

// layers.Linear.forward for 2-D x (decoder_ops.cpp): the same kernels and the same tensors,
// and the step's LoRA adapters inside decoder_layers; `isa` picks the native kernels' instruction set (tests), None the active one.
at::Tensor linear(const at::Tensor& x, const LinearWeights& w, const OptString& isa = std::nullopt);

// native_ops.silu_and_mul for (T, 2 * I) gate_up (decoder_ops.cpp): a new (T, I) tensor.
at::Tensor silu_and_mul(const at::Tensor& gate_up, const OptString& isa = std::nullopt);

// SparseMoE.forward for (T, hidden) x (moe_ops.cpp).
at::Tensor sparse_moe(const at::Tensor& x, const c10::intrusive_ptr<MoeWeights>& weights,
                      const OptString& isa);

}  // namespace pagedserve
