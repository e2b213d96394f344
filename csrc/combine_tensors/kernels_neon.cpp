// Kernel table built with the neon target flags (see setup.py: SIMD_FLAGS).
#define APEX_SIMD_NS simd_neon
#define APEX_SIMD_NAME "neon"
// fp16 loads and stores through FCVTL / FCVTN (common.h): architectural on AArch64, so the flags are those of the
// baseline level, which keeps the soft conversions as the reference this level is compared with bitwise.
#define APEX_AARCH64_F16_CONVERT 1
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_neon() { return simd_neon::table; }
const OptimKernels& optim_kernels_neon() { return simd_neon::optim_table; }
}  // namespace apexc
