// The module's entry points, compiled as one translation unit: each *_ops.cpp file (and
// dispatch.cpp, thread_pool.cpp) includes torch's headers, whose parsing took most of
// each file's compile, about 6 s of 8-18 s. One unit parses them once: 29 CPU-s for the
// nine files against 97 apart (gcc -O3, a 2-core AVX2 VM), in every build, the wheel's
// and `make install`'s. The files stay apart for reading; each still compiles alone, and
// their file-local names (anonymous namespaces) must not collide with one another's.
// The kernels (KERNELS in setup.py) are separate units, compiled once per instruction set.

#include "dispatch.cpp"
#include "thread_pool.cpp"
#include "attention_ops.cpp"
#include "elementwise_ops.cpp"
#include "quant_ops.cpp"
#include "bf16_linear_ops.cpp"
#include "decoder_ops.cpp"
#include "lora_ops.cpp"
#include "moe_ops.cpp"
