// Kernel table built with the baseline target flags (see setup.py: SIMD_FLAGS).
#define APEX_SIMD_NS simd_baseline
#define APEX_SIMD_NAME "baseline"
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_baseline() { return simd_baseline::table; }
const OptimKernels& optim_kernels_baseline() { return simd_baseline::optim_table; }
}  // namespace apexc
