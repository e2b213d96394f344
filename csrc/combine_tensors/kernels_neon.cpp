// Kernel table built with the neon target flags (see setup.py: SIMD_FLAGS).
#define APEX_SIMD_NS simd_neon
#define APEX_SIMD_NAME "neon"
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_neon() { return simd_neon::table; }
const OptimKernels& optim_kernels_neon() { return simd_neon::optim_table; }
}  // namespace apexc
