// One instruction set's paged-attention item kernel (see attention_ops.cpp for the
// algorithm, kernels.h for how the instruction sets are built and chosen). With AVX-512,
// the head sizes below run attention_avx512.h, and with AVX2 attention_avx2.h; the others,
// and every head size in the other sets, run attention_portable.h. bf16 uses AVX512_BF16
// dot products where the set has them.

#include "attention_common.h"
#include "attention_portable.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#include "attention_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_AVX2 1
#include "attention_avx2.h"
#endif

namespace pagedserve::PAGEDSERVE_ISA {

namespace {

// The item's KV heads one after the other, for the kernels that take one at a time.
template <typename T, typename Kernel>
void each_head(const Problem<T>& pb, const WorkItem& item, Scratch& scratch, Kernel kernel) {
  WorkItem one = item;
  one.kv_heads = 1;
  for (int32_t h = 0; h < item.kv_heads; ++h) {
    one.kv_head = item.kv_head + h;
    kernel(pb, one, scratch);
  }
}

}  // namespace

template <typename T>
void attention_item(const Problem<T>& pb, const WorkItem& item, Scratch& scratch) {
#ifdef PAGEDSERVE_AVX512
  auto kernel = [](const Problem<T>& p, const WorkItem& it, Scratch& s) {
    switch (p.head_dim) {
      case 16: return avx512::attention_item<T, 1>(p, it, s);
      case 32: return avx512::attention_item<T, 2>(p, it, s);
      case 64: return avx512::attention_item<T, 4>(p, it, s);
      case 80: return avx512::attention_item<T, 5>(p, it, s);
      case 96: return avx512::attention_item<T, 6>(p, it, s);
      case 128: return avx512::attention_item<T, 8>(p, it, s);
      case 256: return avx512::attention_item<T, 16>(p, it, s);
      default: return portable::attention_item<T>(p, it, s);
    }
  };
  each_head(pb, item, scratch, kernel);
#elif defined(PAGEDSERVE_AVX2)
  switch (pb.head_dim) {  // these take several KV heads at once
    case 16: return avx2::attention_item<T, 2>(pb, item, scratch);
    case 32: return avx2::attention_item<T, 4>(pb, item, scratch);
    case 48: return avx2::attention_item<T, 6>(pb, item, scratch);
    case 64: return avx2::attention_item<T, 8>(pb, item, scratch);
    case 80: return avx2::attention_item<T, 10>(pb, item, scratch);
    case 96: return avx2::attention_item<T, 12>(pb, item, scratch);
    case 128: return avx2::attention_item<T, 16>(pb, item, scratch);
    case 256: return avx2::attention_item<T, 32>(pb, item, scratch);
    default: return each_head(pb, item, scratch, portable::attention_item<T>);
  }
#else
  each_head(pb, item, scratch, portable::attention_item<T>);
#endif
}

template void attention_item<float>(const Problem<float>&, const WorkItem&, Scratch&);
template void attention_item<c10::BFloat16>(const Problem<c10::BFloat16>&, const WorkItem&,
                                            Scratch&);
template void attention_item<c10::Half>(const Problem<c10::Half>&, const WorkItem&, Scratch&);

}  // namespace pagedserve::PAGEDSERVE_ISA
