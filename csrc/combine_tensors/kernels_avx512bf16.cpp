// Kernel table built with the avx512bf16 target flags (see setup.py: SIMD_FLAGS): the avx512 kernels with bf16
// stores through VCVTNEPS2BF16 (common.h: f32_to_bf16).
#define APEX_SIMD_NS simd_avx512bf16
#define APEX_SIMD_NAME "avx512bf16"
#include "kernels_impl.h"
#include "optim_impl.h"

namespace apexc {
const Kernels& kernels_avx512bf16() { return simd_avx512bf16::table; }
const OptimKernels& optim_kernels_avx512bf16() { return simd_avx512bf16::optim_table; }
}  // namespace apexc
