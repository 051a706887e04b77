// One instruction set's paged-attention item kernel (attention_ops.cpp has the algorithm's
// outline, kernels.h how the sets are built and chosen). The item itself is written once,
// in attention_item.h; this file only picks the set's vector primitives and instantiates
// it for the head sizes worth a compiled-in vector count. Other head sizes run with the
// count known at run time, and a head size the set's vector does not divide runs on
// VecScalar.

#include "attention_common.h"
#include "attention_item.h"
#include "kernels.h"
#include "simd_portable.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "simd_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#endif

namespace pagedserve::PAGEDSERVE_ISA {

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
using Vec = avx512::Vec512Bf16;
#elif defined(__AVX512F__) && defined(__AVX512BW__)
using Vec = avx512::Vec512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using Vec = avx2::Vec256;
#else
using Vec = VecGeneric;
#endif

template <typename T, int D>
void item_of_size(const Problem<T>& pb, const WorkItem& item, Scratch& scratch) {
  if constexpr (D % Vec::W == 0) {
    run_attention_item<Vec, T, D / Vec::W>(pb, item, scratch);
  } else {
    run_attention_item<VecScalar, T, 0>(pb, item, scratch);
  }
}

}  // namespace

template <typename T>
void attention_item(const Problem<T>& pb, const WorkItem& item, Scratch& scratch) {
  switch (pb.head_dim) {
    case 16: return item_of_size<T, 16>(pb, item, scratch);
    case 32: return item_of_size<T, 32>(pb, item, scratch);
    case 48: return item_of_size<T, 48>(pb, item, scratch);
    case 64: return item_of_size<T, 64>(pb, item, scratch);
    case 80: return item_of_size<T, 80>(pb, item, scratch);
    case 96: return item_of_size<T, 96>(pb, item, scratch);
    case 128: return item_of_size<T, 128>(pb, item, scratch);
    case 256: return item_of_size<T, 256>(pb, item, scratch);
    default:
      if (pb.head_dim % Vec::W == 0) return run_attention_item<Vec, T, 0>(pb, item, scratch);
      return run_attention_item<VecScalar, T, 0>(pb, item, scratch);
  }
}

template void attention_item<float>(const Problem<float>&, const WorkItem&, Scratch&);
template void attention_item<c10::BFloat16>(const Problem<c10::BFloat16>&, const WorkItem&,
                                            Scratch&);
template void attention_item<c10::Half>(const Problem<c10::Half>&, const WorkItem&, Scratch&);

}  // namespace pagedserve::PAGEDSERVE_ISA
