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
  APEX_BUILD_JOBS   parallel compiler processes (default: CPU count); the translation units are independent
"""

import os
import platform
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

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
        # Source paths recorded in the objects (assert messages, debug info) relative to the tree, so a build in
        # another directory (pip and `python -m build` use temporary ones) yields the same bytes.
        f"-ffile-prefix-map={os.path.dirname(os.path.abspath(__file__))}=.",
    ]
    flags += ["-O0", "-g"] if debug else ["-O3", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2"]
    return flags


def link_flags():
    flags = ["-Wl,-z,relro", "-Wl,-z,now", "-Wl,-z,noexecstack"]
    if os.environ.get("APEX_DEBUG") != "1" and os.environ.get("APEX_NO_STRIP") != "1":
        flags.append("-Wl,-s")
    return flags


def _newer(sources, target):
    """True when target is missing or older than any source (the up-to-date rule setuptools applies)."""
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(src) > built for src in sources if os.path.exists(src))


def _no_rpath(cmd):
    """Drop -Wl,-rpath entries: some interpreters (pyenv) record them in LDSHARED, and a wheel must not carry one."""
    return [a for a in cmd if not a.startswith(("-Wl,-rpath", "-Wl,-R", "-Wl,--enable-new-dtags"))]


class BuildSimd(build_ext):
    """Compiles every translation unit (each SIMD level with its own flags) in parallel, then links once."""

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx"):
            if getattr(self.compiler, attr, None):
                setattr(self.compiler, attr, _no_rpath(getattr(self.compiler, attr)))
        super().build_extensions()

    def get_ext_filename(self, ext_name):
        # Cross builds (APEX_TARGET_ARCH differs from this interpreter) get the target's multiarch triplet in the
        # module suffix, e.g. .cpython-311-aarch64-linux-gnu.so, which is what the target interpreter imports.
        name = super().get_ext_filename(ext_name)
        host = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
        want = f"{target_arch()}-linux-gnu"
        return name.replace(host, want) if host != want and host in name else name

    def build_extension(self, ext):
        arch = target_arch()
        units = [(src, []) for src in sorted(ext.sources)]
        units += [
            (os.path.join(SRC, f"kernels_{level}.cpp"), extra)
            for level, extra in SIMD_FLAGS[arch].items()
            if level != "baseline"
        ]
        ext_path = self.get_ext_fullpath(ext.name)
        # What the objects were built with: another compiler, target or flags (an in-place GCC build, then the
        # release toolchain's zig in the same tree) rebuilds everything instead of linking or shipping old objects.
        recipe = repr((self.compiler.compiler_so, self.compiler.linker_so, os.environ.get("APEX_ZIG_TARGET"), arch,
                       ext.extra_compile_args, ext.extra_link_args, ext.define_macros))
        stamp = os.path.join(self.build_temp, "apex_C.recipe")
        same_recipe = os.path.exists(stamp) and open(stamp, encoding="utf-8").read() == recipe
        if not (self.force or not same_recipe or _newer([u for u, _ in units] + list(ext.depends), ext_path)):
            return  # (past this point every unit is compiled: compile() itself never skips an object)

        def compile_unit(unit):
            src, extra = unit
            return self.compiler.compile(
                [src],
                output_dir=self.build_temp,
                include_dirs=ext.include_dirs,
                macros=ext.define_macros,
                debug=self.debug,
                extra_postargs=ext.extra_compile_args + extra,
                depends=ext.depends,
            )

        jobs = int(os.environ.get("APEX_BUILD_JOBS") or os.cpu_count() or 1)
        with ThreadPoolExecutor(max(1, min(jobs, len(units)))) as pool:
            # The kernel units are the slow ones: start them first. Results are gathered in unit order, so the
            # link line (and the .so) is the same whatever finishes first.
            order = sorted(range(len(units)), key=lambda i: "kernels_" not in units[i][0])
            started = {i: pool.submit(compile_unit, units[i]) for i in order}
            objects = [obj for i in range(len(units)) for obj in started[i].result()]

        # Link through setuptools (libraries, export symbols, target language) with nothing left to compile.
        sources, extra_objects, force = ext.sources, ext.extra_objects, self.force
        ext.sources, ext.extra_objects, self.force = [], objects + list(extra_objects or []), True
        try:
            super().build_extension(ext)
        finally:
            ext.sources, ext.extra_objects, self.force = sources, extra_objects, force
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(recipe)


# The start-up hook that makes `import amp_C` find apex's ops before `import apex` (src/_apex_amp_c.py). A .pth
# file must sit at the top of site-packages, which no package or module option of setuptools places there.
PTH = "apex-amp_C.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


def extension():
    import pybind11

    version = os.environ.get("APEX_BUILD_VERSION", "")
    macros = [("APEX_VERSION", f'"{version}"')] if version else []
    headers = [os.path.join(SRC, h)
               for h in ("common.h", "operands.h", "optim.h", "kernels_impl.h", "optim_impl.h", "bf16_avx2.h")]
    return Extension(
        "apex_C",
        sources=[os.path.join(SRC, f) for f in ("module.cpp", "dispatch.cpp", "kernels_baseline.cpp")],
        include_dirs=[pybind11.get_include(), SRC],
        define_macros=macros,
        extra_compile_args=common_flags(),
        extra_link_args=link_flags(),
        # dlsym finds the process's OpenMP runtime (dispatch.cpp); it lives in libdl up to glibc 2.33
        libraries=["dl"] if sys.platform.startswith("linux") else [],
        depends=headers,
        language="c++",
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildSimd, "build_py": BuildPyWithPth})
