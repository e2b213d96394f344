// Kernel table built with the avx512 target flags (see setup.py: SIMD_FLAGS).
#define APEX_SIMD_NS simd_avx512
#define APEX_SIMD_NAME "avx512"
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_avx512() { return simd_avx512::table; }
const OptimKernels& optim_kernels_avx512() { return simd_avx512::optim_table; }
}  // namespace apexc
