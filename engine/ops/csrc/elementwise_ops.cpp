// The fused elementwise ops' entry points (kernels in elementwise_kernels.cpp): tensor
// checks, the split of rows over torch's threads, and the instruction set (kernels.h).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels.h"
#include "parallel.h"

namespace pagedserve {
namespace {

// Rows per parallel task: at least this many elements, so that steps of up to a few
// hundred tokens stay on one thread instead of paying for a fork-join: waking the other
// threads (which sleep at barriers in the engine core) costs more than these rows take. On
// a 2-core Zen 5 VM, 1 << 17 rather than 1 << 15 took a 64-stream step's norms, rotary and
// SiLU from 16-18% of its time to 9%, and the step from 38.6-45.4 to 36.7-37.1 ms
// (benchmarks/step_profile.py --workload throughput).
constexpr int64_t kMinElementsPerTask = 1 << 17;

// Runs rows(args, begin, end) over 0..num_rows on torch's thread pool.
template <typename Args>
void parallel_rows(void (*rows)(const Args&, int64_t, int64_t), const Args& args,
                   int64_t num_rows, int64_t row_elements) {
  const int64_t grain =
      std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, row_elements));
  parallel_for(0, num_rows, grain,
                   [&](int64_t begin, int64_t end) { rows(args, begin, end); });
}

void check_rows(const at::Tensor& t, int64_t H, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == H && t.stride(1) == 1,
              what, " must be a CPU (rows, ", H, ") tensor with contiguous rows");
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              const std::optional<std::string>& isa) {
  const int64_t H = weight.size(0);
  check_rows(out, H, "out");
  check_rows(x, H, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && out.size(0) == x.size(0) &&
                  x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: shapes or dtypes disagree");
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const RmsNormRows<T> args{out.data_ptr<T>(), out.stride(0), x.data_ptr<T>(), x.stride(0),
                              nullptr,           0,             weight.data_ptr<T>(), H,
                              static_cast<float>(eps)};
    parallel_rows(kernels_for(isa).of<T>().rms_norm_rows, args, x.size(0), H);
  });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps,
                        const std::optional<std::string>& isa) {
  const int64_t H = weight.size(0);
  check_rows(x, H, "x");
  check_rows(residual, H, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && residual.size(0) == x.size(0) &&
                  x.scalar_type() == residual.scalar_type() &&
                  x.scalar_type() == weight.scalar_type(),
              "fused_add_rms_norm: shapes or dtypes disagree");
  dispatch_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    const RmsNormRows<T> args{xp, x.stride(0), xp, x.stride(0), residual.data_ptr<T>(),
                              residual.stride(0), weight.data_ptr<T>(), H,
                              static_cast<float>(eps)};
    parallel_rows(kernels_for(isa).of<T>().rms_norm_rows, args, x.size(0), H);
  });
}

void check_heads(const at::Tensor& t, int64_t D, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.size(2) == D && t.stride(2) == 1 &&
                  t.stride(1) == D,
              what, " must be a CPU (tokens, heads, ", D, ") tensor with contiguous heads");
}

void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin, const std::optional<std::string>& isa) {
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
  dispatch_dtype(q.scalar_type(), "rotary", [&](auto tag) {
    using S = decltype(tag);
    const RopeRows<S> args{q.data_ptr<S>(),  q.stride(0),       q.size(1),       k.data_ptr<S>(),
                           k.stride(0),      k.size(1),         cos.data_ptr<S>(),
                           sin.data_ptr<S>(), D};
    parallel_rows(kernels_for(isa).of<S>().rope_rows, args, T, (q.size(1) + k.size(1)) * D);
  });
}

void silu_and_mul_into(const at::Tensor& out, const at::Tensor& gate_up,
                       const std::optional<std::string>& isa) {
  const int64_t I = out.size(-1);
  check_rows(out, I, "out");
  check_rows(gate_up, 2 * I, "gate_up");
  TORCH_CHECK(out.size(0) == gate_up.size(0) && out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: shapes or dtypes disagree");
  dispatch_dtype(out.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const SiluAndMulRows<T> args{out.data_ptr<T>(), out.stride(0), gate_up.data_ptr<T>(),
                                 gate_up.stride(0), I};
    parallel_rows(kernels_for(isa).of<T>().silu_and_mul_rows, args, out.size(0), I);
  });
}

}  // namespace
}  // namespace pagedserve

// isa: run this instruction set's kernels instead of the CPU's best (for tests).
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps, str? isa=None) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "str? isa=None) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, str? isa=None) "
      "-> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up, str? isa=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &pagedserve::rms_norm);
  m.impl("fused_add_rms_norm", &pagedserve::fused_add_rms_norm);
  m.impl("rotary_embedding", &pagedserve::rotary_embedding);
  m.impl("silu_and_mul", &pagedserve::silu_and_mul_into);
}
