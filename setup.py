"""Build of the torch-free C++ core (`apex_C`); all metadata lives in pyproject.toml.

The kernels in csrc/combine_tensors/kernels_impl.h and optim_impl.h are compiled
once per SIMD level, each translation unit with its own target flags, and the
best level is picked at run time (never -march=native). The extension includes
only pybind11 and the C++ standard library: no libtorch, so one build serves
every torch version.

Environment knobs:
  APEX_TARGET_ARCH  x86_64 | aarch64 (default: this machine; set when cross-compiling, e.g. with zig)
  APEX_DEBUG=1      -O0 -g, not stripped
  APEX_NO_STRIP=1   keep symbols (the release flow strips separately)
"""

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = os.path.join("csrc", "combine_tensors")

# Per-level target flags. Each level is a separate translation unit.
SIMD_FLAGS = {
    "x86_64": {
        "baseline": [],
        "avx2": ["-mavx2", "-mfma", "-mf16c"],
        "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    },
    "aarch64": {
        "baseline": [],
        "neon": [],  # Advanced SIMD is part of the AArch64 baseline
    },
}


def target_arch():
    arch = os.environ.get("APEX_TARGET_ARCH") or platform.machine()
    arch = {"amd64": "x86_64", "AMD64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    if arch not in SIMD_FLAGS:
        raise RuntimeError(f"apex_C: unsupported target architecture {arch!r}; expected x86_64 or aarch64")
    return arch


def common_flags():
    debug = os.environ.get("APEX_DEBUG") == "1"
    flags = [
        "-std=c++17",
        "-fvisibility=hidden",
        "-fno-math-errno",  # lets std::sqrt vectorise (errno is never read)
        "-ffp-contract=off",  # same rounding at every SIMD level
        "-fstack-protector-strong",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
    ]
    flags += ["-O0", "-g"] if debug else ["-O3", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2"]
    return flags


def link_flags():
    flags = ["-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack"]
    if os.environ.get("APEX_DEBUG") != "1" and os.environ.get("APEX_NO_STRIP") != "1":
        flags.append("-Wl,-s")
    return flags


class BuildSimd(build_ext):
    """Compiles each SIMD translation unit with its own flags, then links them in."""

    def build_extension(self, ext):
        arch = target_arch()
        objects = []
        for level, extra in SIMD_FLAGS[arch].items():
            if level == "baseline":
                continue
            objects += self.compiler.compile(
                [os.path.join(SRC, f"kernels_{level}.cpp")],
                output_dir=self.build_temp,
                include_dirs=ext.include_dirs,
                macros=ext.define_macros,
                extra_postargs=ext.extra_compile_args + extra,
                depends=ext.depends,
            )
        ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


def extension():
    import pybind11

    version = os.environ.get("APEX_BUILD_VERSION", "")
    macros = [("APEX_VERSION", f'"{version}"')] if version else []
    headers = [os.path.join(SRC, h) for h in ("common.h", "optim.h", "kernels_impl.h", "optim_impl.h")]
    return Extension(
        "apex_C",
        sources=[os.path.join(SRC, f) for f in ("module.cpp", "dispatch.cpp", "kernels_baseline.cpp")],
        include_dirs=[pybind11.get_include(), SRC],
        define_macros=macros,
        extra_compile_args=common_flags(),
        extra_link_args=link_flags(),
        depends=headers,
        language="c++",
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildSimd})
