// One instruction set's paged-attention item kernel (see attention_ops.cpp for the
// algorithm, kernels.h for how the instruction sets are built and chosen). With AVX-512,
// the head sizes below run attention_avx512.h and the others attention_portable.h; without
// it, attention_portable.h runs everything. bf16 uses AVX512_BF16 dot products where the
// set has them.

#include "attention_common.h"
#include "attention_portable.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#include "attention_avx512.h"
#endif

namespace pagedserve::PAGEDSERVE_ISA {

template <typename T>
void attention_item(const Problem<T>& pb, const WorkItem& item, Scratch& scratch) {
#ifdef PAGEDSERVE_AVX512
  switch (pb.head_dim) {
    case 16: return avx512::attention_item<T, 1>(pb, item, scratch);
    case 32: return avx512::attention_item<T, 2>(pb, item, scratch);
    case 64: return avx512::attention_item<T, 4>(pb, item, scratch);
    case 80: return avx512::attention_item<T, 5>(pb, item, scratch);
    case 96: return avx512::attention_item<T, 6>(pb, item, scratch);
    case 128: return avx512::attention_item<T, 8>(pb, item, scratch);
    case 256: return avx512::attention_item<T, 16>(pb, item, scratch);
    default: break;
  }
#endif
  portable::attention_item<T>(pb, item, scratch);
}

template void attention_item<float>(const Problem<float>&, const WorkItem&, Scratch&);
template void attention_item<c10::BFloat16>(const Problem<c10::BFloat16>&, const WorkItem&,
                                            Scratch&);
template void attention_item<c10::Half>(const Problem<c10::Half>&, const WorkItem&, Scratch&);

}  // namespace pagedserve::PAGEDSERVE_ISA
