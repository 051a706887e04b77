// Which instruction set's kernels run (kernels.h): the best one this CPU supports, found
// once from its CPUID features (with the OS's support for the AVX-512 registers, which
// __builtin_cpu_supports checks too), unless select_cpu_isa picked another this CPU runs.
// Only the sets this build holds (the PAGEDSERVE_WITH_ISA_* macros setup.py defines) are
// in the table. Also the ops that say what this build holds.

#include <c10/util/Exception.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
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

// Everything each set is compiled with (setup.py's -m flags); each check is defined where
// a set built needs it (a larger set's check starts from the smaller one's).
#if defined(PAGEDSERVE_WITH_ISA_AVX2) || defined(PAGEDSERVE_WITH_ISA_AVX512) || \
    defined(PAGEDSERVE_WITH_ISA_AVX512_BF16)
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif

#if defined(PAGEDSERVE_WITH_ISA_AVX512) || defined(PAGEDSERVE_WITH_ISA_AVX512_BF16)
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}
#endif

#ifdef PAGEDSERVE_WITH_ISA_AVX512_BF16
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif

#define PAGEDSERVE_TABLE(ns, T)                                                      \
  KernelsFor<T> {                                                                    \
    &ns::attention_item<T>, &ns::rms_norm_rows<T>, &ns::rope_rows<T>,                \
        &ns::silu_and_mul_rows<T>, &ns::lora_rows<T>                                 \
  }
#define PAGEDSERVE_KERNELS(name, ns)                                                  \
  Kernels {                                                                           \
    name, PAGEDSERVE_TABLE(ns, float), PAGEDSERVE_TABLE(ns, c10::BFloat16),           \
        PAGEDSERVE_TABLE(ns, c10::Half), &ns::quant_tiles, &ns::quant_rows_int16,    \
        &ns::bf16_tiles, &ns::int8_row_dots                                           \
  }

struct IsaEntry {
  Kernels kernels;
  bool (*supported)();
};

// Best first.
const std::vector<IsaEntry>& isa_table() {
  static const std::vector<IsaEntry> isas = {
#ifdef PAGEDSERVE_WITH_ISA_AVX512_BF16
      {PAGEDSERVE_KERNELS("avx512_bf16", isa_avx512_bf16), &has_avx512_bf16},
#endif
#ifdef PAGEDSERVE_WITH_ISA_AVX512
      {PAGEDSERVE_KERNELS("avx512", isa_avx512), &has_avx512},
#endif
#ifdef PAGEDSERVE_WITH_ISA_AVX2
      {PAGEDSERVE_KERNELS("avx2", isa_avx2), &has_avx2},
#endif
      {PAGEDSERVE_KERNELS("portable", isa_portable), &always},
  };
  return isas;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const IsaEntry& entry : isa_table()) {
    if (entry.supported()) names.emplace_back(entry.kernels.isa);
  }
  return names;
}

std::vector<std::string> built_isas() {
  std::vector<std::string> names;
  for (const IsaEntry& entry : isa_table()) names.emplace_back(entry.kernels.isa);
  return names;
}

const Kernels& best_kernels() {
  static const Kernels& best = [] () -> const Kernels& {
    for (const IsaEntry& entry : isa_table()) {
      if (entry.supported()) return entry.kernels;
    }
    TORCH_CHECK(false, "no instruction set of the native kernels runs on this CPU");
  }();
  return best;
}

// What active_kernels() returns: every op reads it once per call, so a switch between
// steps takes effect at the next op.
std::atomic<const Kernels*>& selected() {
  static std::atomic<const Kernels*> kernels{&best_kernels()};
  return kernels;
}

std::string cpu_isa() { return active_kernels().isa; }

// Makes every op run `isa`'s kernels ("auto": the best this CPU runs); returns the set now
// in use. Raises for a set this build lacks or this CPU cannot run.
std::string select_cpu_isa(const std::string& isa) {
  const Kernels& kernels = isa == "auto" ? best_kernels() : kernels_named(isa);
  selected().store(&kernels, std::memory_order_release);
  return kernels.isa;
}

c10::Dict<std::string, std::string> build_info() {
  c10::Dict<std::string, std::string> info;
  info.insert("sources_sha256", PAGEDSERVE_STRING(PAGEDSERVE_SOURCES_SHA256));
  info.insert("torch", TORCH_VERSION);
  std::string built;
  for (const std::string& name : built_isas()) built += (built.empty() ? "" : " ") + name;
  info.insert("isas", built);
  return info;
}

}  // namespace

const Kernels& active_kernels() { return *selected().load(std::memory_order_acquire); }

const Kernels& kernels_named(const std::string& isa) {
  for (const IsaEntry& entry : isa_table()) {
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
  m.def("built_isas() -> str[]", &pagedserve::built_isas);
  m.def("select_cpu_isa(str isa) -> str", &pagedserve::select_cpu_isa);
  m.def("build_info() -> Dict(str, str)", &pagedserve::build_info);
}
