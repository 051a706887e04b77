// Which instruction set's kernels run (kernels.h): the best one this CPU supports, found
// once from its CPUID features (with the OS's support for the AVX-512 registers, which
// __builtin_cpu_supports checks too). Also the ops that say what this build holds.

#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#include <string>
#include <vector>

#include "kernels.h"

#ifndef PAGEDSERVE_SOURCES_SHA256
#error "setup.py defines PAGEDSERVE_SOURCES_SHA256, the digest of the sources built"
#endif
#define PAGEDSERVE_STRING_(x) #x
#define PAGEDSERVE_STRING(x) PAGEDSERVE_STRING_(x)

namespace pagedserve {
namespace {

bool always() { return true; }

#ifdef PAGEDSERVE_WITH_X86_ISAS
// Everything each set is compiled with (setup.py's -m flags).
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif

#define PAGEDSERVE_TABLE(ns, T)                                                      \
  KernelsFor<T> {                                                                    \
    &ns::attention_item<T>, &ns::rms_norm_rows<T>, &ns::rope_rows<T>,                \
        &ns::silu_and_mul_rows<T>                                                    \
  }
#define PAGEDSERVE_KERNELS(name, ns)                                                  \
  Kernels {                                                                           \
    name, PAGEDSERVE_TABLE(ns, float), PAGEDSERVE_TABLE(ns, c10::BFloat16),           \
        PAGEDSERVE_TABLE(ns, c10::Half), &ns::quant_tiles, &ns::quant_rows_int16,    \
        &ns::bf16_tiles                                                               \
  }

struct IsaEntry {
  Kernels kernels;
  bool (*supported)();
};

// Best first.
const std::vector<IsaEntry>& built_isas() {
  static const std::vector<IsaEntry> isas = {
#ifdef PAGEDSERVE_WITH_X86_ISAS
      {PAGEDSERVE_KERNELS("avx512_bf16", isa_avx512_bf16), &has_avx512_bf16},
      {PAGEDSERVE_KERNELS("avx512", isa_avx512), &has_avx512},
      {PAGEDSERVE_KERNELS("avx2", isa_avx2), &has_avx2},
#endif
      {PAGEDSERVE_KERNELS("portable", isa_portable), &always},
  };
  return isas;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const IsaEntry& entry : built_isas()) {
    if (entry.supported()) names.emplace_back(entry.kernels.isa);
  }
  return names;
}

std::string cpu_isa() { return active_kernels().isa; }

c10::Dict<std::string, std::string> build_info() {
  c10::Dict<std::string, std::string> info;
  info.insert("sources_sha256", PAGEDSERVE_STRING(PAGEDSERVE_SOURCES_SHA256));
  info.insert("torch", TORCH_VERSION);
  std::string built;
  for (const IsaEntry& entry : built_isas()) {
    built += (built.empty() ? "" : " ") + std::string(entry.kernels.isa);
  }
  info.insert("isas", built);
  return info;
}

}  // namespace

const Kernels& active_kernels() {
  static const Kernels& best = [] () -> const Kernels& {
    for (const IsaEntry& entry : built_isas()) {
      if (entry.supported()) return entry.kernels;
    }
    TORCH_CHECK(false, "no instruction set of the native kernels runs on this CPU");
  }();
  return best;
}

const Kernels& kernels_named(const std::string& isa) {
  for (const IsaEntry& entry : built_isas()) {
    if (isa != entry.kernels.isa) continue;
    TORCH_CHECK(entry.supported(), "this CPU cannot run the ", isa, " kernels");
    return entry.kernels;
  }
  TORCH_CHECK(false, "this build has no ", isa, " kernels");
}

}  // namespace pagedserve

TORCH_LIBRARY(pagedserve, m) {
  m.def("cpu_isa() -> str", &pagedserve::cpu_isa);
  m.def("supported_isas() -> str[]", &pagedserve::supported_isas);
  m.def("build_info() -> Dict(str, str)", &pagedserve::build_info);
}
