// Each row's argmax over an LM head's outputs that parallel tasks compute a run of tiles at
// a time, without the (rows, N) logits: greedy tokens from the bfloat16 head
// (bf16_linear_ops.cpp) and from a quantized one (quant_ops.cpp). An output counts by an
// int32 key that orders as the number does (each caller's order_key, NaN the largest). Each
// task keeps each row's best so far; the tasks' bests meet at the end, ties to the lower
// index: an argmax's first index on ties.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

namespace pagedserve {

class RowArgmax {
 public:
  RowArgmax(int64_t tasks, int64_t rows)
      : tasks_(tasks), rows_(rows), key_(tasks * rows, INT32_MIN), index_(tasks * rows, -1) {}

  // Task `task`'s outputs of row r at columns n0..n0 + cols, key(c) for column n0 + c
  // (cols >= 1). A task's runs go up the columns: only a key larger than its best wins.
  template <typename KeyOf>
  void offer(int64_t task, int64_t r, int64_t n0, int64_t cols, const KeyOf& key) {
    int32_t top = INT32_MIN;
    for (int64_t c = 0; c < cols; ++c) top = std::max(top, key(c));
    const int64_t slot = task * rows_ + r;
    if (top <= key_[slot]) return;
    int64_t c = 0;
    while (key(c) != top) ++c;
    key_[slot] = top;
    index_[slot] = n0 + c;
  }

  // Each row's argmax into out (rows,).
  void write(int64_t* out) const {
    for (int64_t r = 0; r < rows_; ++r) {
      int32_t key = INT32_MIN;
      int64_t index = -1;
      for (int64_t task = 0; task < tasks_; ++task) {
        const int32_t k = key_[task * rows_ + r];
        const int64_t i = index_[task * rows_ + r];
        if (i >= 0 && (k > key || (k == key && i < index))) key = k, index = i;
      }
      out[r] = index;
    }
  }

 private:
  int64_t tasks_, rows_;
  std::vector<int32_t> key_;
  std::vector<int64_t> index_;
};

}  // namespace pagedserve
