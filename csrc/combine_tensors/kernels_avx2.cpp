// Kernel table built with the avx2 target flags (see setup.py: SIMD_FLAGS).
#define APEX_SIMD_NS simd_avx2
#define APEX_SIMD_NAME "avx2"
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_avx2() { return simd_avx2::table; }
const OptimKernels& optim_kernels_avx2() { return simd_avx2::optim_table; }
}  // namespace apexc
