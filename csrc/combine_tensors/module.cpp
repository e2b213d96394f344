// Python bindings of the torch-free core (module `apex_C`).
//
// Buffers cross this boundary as (address, element count, dtype code): torch
// passes tensor.data_ptr(), numpy passes array.ctypes.data. The Python layer
// (apex._core) checks devices, contiguity and lifetimes; this layer checks
// everything a bad call could turn into memory corruption that it can see.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "common.h"
#include "optim.h"

namespace py = pybind11;
using namespace apexc;

namespace apexc {
std::vector<std::string> supported_levels();
void set_simd_level(const std::string& level);
void init_dispatch();
}  // namespace apexc

namespace {

void check_dtype(int dt, const char* what) {
  if (!valid_dtype(dt))
    throw py::value_error(std::string(what) + ": expected a dtype code 0 (float32), 1 (float16) or 2 (bfloat16), got " +
                          std::to_string(dt));
}

void check_buffer(std::uintptr_t ptr, idx_t n, int dt, const char* what) {
  check_dtype(dt, what);
  if (n < 0) throw py::value_error(std::string(what) + ": expected a non-negative element count, got " + std::to_string(n));
  if (n > 0 && ptr == 0) throw py::value_error(std::string(what) + ": null address for a non-empty buffer");
  if (ptr % dtype_size(dt) != 0)
    throw py::value_error(std::string(what) + ": address is not aligned to its element size " +
                          std::to_string(dtype_size(dt)));
}

// Elementwise kernels may run in place (same start, same dtype) but never on
// shifted or differently-typed views of one memory range: the threads would
// read what another already wrote.
void check_overlap(std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, const char* what) {
  if (n <= 0) return;
  const std::uintptr_t send = src + static_cast<std::uintptr_t>(n) * dtype_size(sdt);
  const std::uintptr_t dend = dst + static_cast<std::uintptr_t>(n) * dtype_size(ddt);
  if (src == dst && sdt == ddt) return;
  if (src == dst)
    throw py::value_error(std::string(what) + ": an in-place call needs the same dtype on both sides");
  if (src < dend && dst < send)
    throw py::value_error(std::string(what) + ": src and dst overlap partially; expected identical or disjoint buffers");
}

template <class T>
T* as_ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Every slot with elements needs a non-null grad address aligned to the grad dtype.
void check_gather_table(const OptArgs& a) {
  const std::size_t size = dtype_size(a.gdt);
  for (idx_t k = 0; k < a.nseg; ++k) {
    if (a.skip && a.skip[k]) continue;
    const idx_t n = (a.seg_end ? a.seg_end[k] : a.seg[k + 1]) - a.seg[k];
    if (n > 0 && a.gtab[k] == 0)
      throw py::value_error("OptArgs.gtab: slot " + std::to_string(k) + " has a null grad address");
    if (a.gtab[k] % size != 0)
      throw py::value_error("OptArgs.gtab: grad address of slot " + std::to_string(k) +
                            " is not aligned to its element size " + std::to_string(size));
  }
}

struct PyOptArgs {
  OptArgs a;
  std::uintptr_t p = 0, g = 0, s0 = 0, s1 = 0, s2 = 0, out = 0, seg = 0, seg_end = 0, steps = 0, skip = 0, first = 0;
  std::uintptr_t seg_mul = 0, seg_gmul = 0, seg_aux = 0, seg_out = 0;
  std::uintptr_t gtab = 0;  // address of nseg grad addresses (uint64), or 0 for the flat grad buffer g
  std::vector<double> hp;

  const OptArgs& resolve() {
    a.p = as_ptr<void>(p);
    a.g = as_ptr<const void>(g);
    a.s[0] = as_ptr<void>(s0);
    a.s[1] = as_ptr<void>(s1);
    a.s[2] = as_ptr<void>(s2);
    a.out = as_ptr<void>(out);
    a.seg = as_ptr<const idx_t>(seg);
    a.seg_end = as_ptr<const idx_t>(seg_end);
    a.steps = as_ptr<const float>(steps);
    a.skip = as_ptr<const std::uint8_t>(skip);
    a.first = as_ptr<const std::uint8_t>(first);
    a.seg_mul = as_ptr<const float>(seg_mul);
    a.seg_gmul = as_ptr<const float>(seg_gmul);
    a.seg_aux = as_ptr<const float>(seg_aux);
    a.seg_out = as_ptr<double>(seg_out);
    a.gtab = as_ptr<const std::uintptr_t>(gtab);
    if (hp.size() > 12) throw py::value_error("OptArgs.hp: at most 12 hyperparameters, got " + std::to_string(hp.size()));
    for (std::size_t i = 0; i < 12; ++i) a.hp[i] = i < hp.size() ? hp[i] : 0.0;
    check_dtype(a.pdt, "OptArgs.pdt");
    check_dtype(a.gdt, "OptArgs.gdt");
    if (a.out) check_dtype(a.odt, "OptArgs.odt");
    bool ok = (a.pdt == a.gdt && !a.out) || a.pdt == F32;
    if (a.pdt == F32 && a.out && a.odt == F32) ok = false;
    if (a.pdt == F32 && a.gdt != F32 && a.out && a.odt != a.gdt) ok = false;
    if (!ok)
      throw py::value_error("OptArgs: unsupported dtype combination param=" + std::to_string(a.pdt) +
                            " grad=" + std::to_string(a.gdt) + " out=" + (a.out ? std::to_string(a.odt) : "none") +
                            "; expected grads in the param dtype, or float32 params with a float16/bfloat16 "
                            "grad/out");
    if (a.nseg < 0) throw py::value_error("OptArgs.nseg must be >= 0");
    if (a.nseg > 0 && (!a.p || (!a.g && !a.gtab) || !a.seg))
      throw py::value_error("OptArgs: p, g (or gtab) and seg are required when nseg > 0");
    if (a.gtab && a.nseg > 0) check_gather_table(a);
    return a;
  }
};

using OptFn = void (*)(const OptArgs&);
// Which state slots (s0, s1, s2) a kernel dereferences for the given arguments.
using SlotFn = int (*)(const OptArgs&);

void check_slots(const OptArgs& a, int need, const char* name) {
  if (a.nseg <= 0) return;
  for (int i = 0; i < 3; ++i)
    if ((need >> i) & 1 && !a.s[i])
      throw py::value_error(std::string(name) + ": state slot s" + std::to_string(i) +
                            " is required for these options but is 0");
}

void run_opt(OptFn OptimKernels::*which, PyOptArgs& args, bool needs_steps, bool needs_out, const char* name,
             SlotFn slots) {
  const OptArgs& a = args.resolve();
  check_slots(a, slots(a), name);
  if (needs_steps && a.nseg > 0 && !a.steps)
    throw py::value_error(std::string(name) + ": per-segment steps are required");
  if ((a.flags & kBiasCorrection) && a.nseg > 0 && !a.steps)
    throw py::value_error(std::string(name) + ": FLAG_BIAS_CORRECTION needs per-segment steps");
  if (needs_out && a.nseg > 0 && !a.seg_out)
    throw py::value_error(std::string(name) + ": seg_out (per-segment output) is required");
  OptFn fn = OK().*which;
  py::gil_scoped_release nogil;
  fn(a);
}

}  // namespace

PYBIND11_MODULE(apex_C, m) {
  m.doc() = "apex torch-free kernel core: flat-buffer kernels over raw host memory";
  init_dispatch();

  m.def("supported_simd_levels", &supported_levels, "SIMD levels this CPU and build support, lowest first");
  m.def("simd_level", [] { return std::string(K().name); }, "the SIMD level in use");
  m.def("set_simd_level", &set_simd_level, py::arg("level"),
        "select a SIMD level ('baseline', 'avx2', 'avx512', 'neon' or 'auto'); ValueError if unsupported");
  m.def("get_num_threads", &default_threads);
  m.def("set_num_threads", &set_default_threads, py::arg("n"), "default thread count (<= 0: APEX_NUM_THREADS or all cores)");

  m.def(
      "scale_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, float scale, bool check, int threads) {
        check_buffer(src, n, sdt, "scale_ src");
        check_buffer(dst, n, ddt, "scale_ dst");
        check_overlap(src, sdt, dst, ddt, n, "scale_");
        py::gil_scoped_release nogil;
        return K().scale(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, scale, check, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("scale"),
      py::arg("check") = true, py::arg("threads") = 0,
      "dst = src * scale (dtype-converting, may be in place); returns True if any src value is inf/nan");
  m.def(
      "axpy_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, float scale, bool check, int threads) {
        check_buffer(src, n, sdt, "axpy_ src");
        check_buffer(dst, n, ddt, "axpy_ dst");
        check_overlap(src, sdt, dst, ddt, n, "axpy_");
        py::gil_scoped_release nogil;
        return K().axpy(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, scale, check, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("scale"),
      py::arg("check") = true, py::arg("threads") = 0,
      "dst += src * scale; returns True if any src value is inf/nan");
  m.def(
      "copy_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, int threads) {
        check_buffer(src, n, sdt, "copy_ src");
        check_buffer(dst, n, ddt, "copy_ dst");
        check_overlap(src, sdt, dst, ddt, n, "copy_");
        if (src == dst) return;
        py::gil_scoped_release nogil;
        K().scale(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, 1.0f, false, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("threads") = 0,
      "dtype-converting copy (round to nearest even)");
  m.def(
      "fill_",
      [](std::uintptr_t dst, int dt, idx_t n, float value, int threads) {
        check_buffer(dst, n, dt, "fill_");
        py::gil_scoped_release nogil;
        K().fill(as_ptr<void>(dst), dt, n, value, threads);
      },
      py::arg("dst"), py::arg("dtype"), py::arg("n"), py::arg("value") = 0.0f, py::arg("threads") = 0);
  m.def(
      "has_nonfinite",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "has_nonfinite");
        py::gil_scoped_release nogil;
        return K().has_nonfinite(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0);
  m.def(
      "sum_sq",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "sum_sq");
        py::gil_scoped_release nogil;
        return K().sum_sq(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0,
      "sum of squares in float64 accumulators; identical for any thread count");
  m.def(
      "max_abs",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "max_abs");
        py::gil_scoped_release nogil;
        return K().max_abs(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0, "max |x| (nan if any nan)");
  m.def(
      "segment_sum_sq",
      [](std::uintptr_t src, int dt, std::uintptr_t seg, idx_t nseg, std::uintptr_t out, int threads) {
        if (nseg < 0) throw py::value_error("segment_sum_sq: nseg must be >= 0");
        if (nseg > 0 && (!seg || !out)) throw py::value_error("segment_sum_sq: seg and out are required");
        const idx_t* s = as_ptr<const idx_t>(seg);
        if (nseg > 0) {
          for (idx_t k = 0; k < nseg; ++k)
            if (s[k] > s[k + 1] || s[k] < 0) throw py::value_error("segment_sum_sq: segment offsets must be non-decreasing and >= 0");
          check_buffer(src, s[nseg], dt, "segment_sum_sq");
        }
        py::gil_scoped_release nogil;
        K().segment_sum_sq(as_ptr<const void>(src), dt, Segments{s, nseg}, as_ptr<double>(out), threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("seg"), py::arg("nseg"), py::arg("out"), py::arg("threads") = 0,
      "out[k] = sum of squares of src[seg[k]:seg[k+1]] (float64 out, nseg+1 int64 offsets)");

  m.def(
      "_raw_scale_gather_",
      [](std::uintptr_t addr, std::uintptr_t numel, idx_t n, int dt, float scale, bool check, int threads) {
        check_dtype(dt, "_raw_scale_gather_");
        if (n < 0) throw py::value_error("_raw_scale_gather_: n must be >= 0, got " + std::to_string(n));
        if (n > 0 && (!addr || !numel)) throw py::value_error("_raw_scale_gather_: addr and numel tables are required");
        const std::uintptr_t* ad = as_ptr<const std::uintptr_t>(addr);
        const idx_t* nu = as_ptr<const idx_t>(numel);
        const std::size_t size = dtype_size(dt);
        for (idx_t j = 0; j < n; ++j)  // message built only on failure: this runs once per grad per step
          if (nu[j] < 0 || (nu[j] > 0 && ad[j] == 0) || ad[j] % size != 0)
            check_buffer(ad[j], nu[j], dt, ("_raw_scale_gather_ buffer " + std::to_string(j)).c_str());
        py::gil_scoped_release nogil;
        return OK().scale_gather(ad, nu, n, dt, scale, check, threads);
      },
      py::arg("addr"), py::arg("numel"), py::arg("n"), py::arg("dtype"), py::arg("scale"), py::arg("check") = true,
      py::arg("threads") = 0,
      "x *= scale in place over n disjoint buffers: addr/numel are addresses of n int64 tables (buffer address, "
      "element count); returns True if any value was inf/nan");

  py::class_<PyOptArgs>(m, "OptArgs", "arguments of one optimizer kernel call (addresses as ints)")
      .def(py::init<>())
      .def_readwrite("p", &PyOptArgs::p)
      .def_readwrite("g", &PyOptArgs::g)
      .def_readwrite("s0", &PyOptArgs::s0)
      .def_readwrite("s1", &PyOptArgs::s1)
      .def_readwrite("s2", &PyOptArgs::s2)
      .def_readwrite("out", &PyOptArgs::out)
      .def_readwrite("seg", &PyOptArgs::seg)
      .def_readwrite("seg_end", &PyOptArgs::seg_end)
      .def_readwrite("steps", &PyOptArgs::steps)
      .def_readwrite("skip", &PyOptArgs::skip)
      .def_readwrite("first", &PyOptArgs::first)
      .def_readwrite("seg_mul", &PyOptArgs::seg_mul)
      .def_readwrite("seg_gmul", &PyOptArgs::seg_gmul)
      .def_readwrite("seg_aux", &PyOptArgs::seg_aux)
      .def_readwrite("seg_out", &PyOptArgs::seg_out)
      .def_readwrite("gtab", &PyOptArgs::gtab)
      .def_readwrite("hp", &PyOptArgs::hp)
      .def_property("pdt", [](PyOptArgs& s) { return s.a.pdt; }, [](PyOptArgs& s, int v) { s.a.pdt = v; })
      .def_property("gdt", [](PyOptArgs& s) { return s.a.gdt; }, [](PyOptArgs& s, int v) { s.a.gdt = v; })
      .def_property("sdt", [](PyOptArgs& s) { return s.a.sdt; }, [](PyOptArgs& s, int v) { s.a.sdt = v; })
      .def_property("odt", [](PyOptArgs& s) { return s.a.odt; }, [](PyOptArgs& s, int v) { s.a.odt = v; })
      .def_property("nseg", [](PyOptArgs& s) { return s.a.nseg; }, [](PyOptArgs& s, idx_t v) { s.a.nseg = v; })
      .def_property("flags", [](PyOptArgs& s) { return s.a.flags; }, [](PyOptArgs& s, int v) { s.a.flags = v; })
      .def_property("threads", [](PyOptArgs& s) { return s.a.threads; }, [](PyOptArgs& s, int v) { s.a.threads = v; })
      .def_property("grad_scale", [](PyOptArgs& s) { return s.a.grad_scale; },
                    [](PyOptArgs& s, float v) { s.a.grad_scale = v; });

  auto bind = [&](const char* name, OptFn OptimKernels::*which, bool steps, bool out, SlotFn slots) {
    m.def(name, [which, steps, out, name, slots](PyOptArgs& a) { run_opt(which, a, steps, out, name, slots); },
          py::arg("args"));
  };
  // bit i set = state slot s<i> is dereferenced
  bind("sgd_step", &OptimKernels::sgd, false, false, [](const OptArgs& a) { return a.hp[1] != 0.0 ? 1 : 0; });
  bind("adam_step", &OptimKernels::adam, true, false,
       [](const OptArgs& a) { return (a.flags & kAmsgrad) ? 7 : 3; });
  bind("adadelta_step", &OptimKernels::adadelta, false, false, [](const OptArgs&) { return 3; });
  auto rms_slots = [](const OptArgs& a) { return 1 | (a.hp[4] > 0.0 ? 2 : 0) | ((a.flags & kCentered) ? 4 : 0); };
  bind("rmsprop_step", &OptimKernels::rmsprop, false, false, rms_slots);
  bind("rmsprop_tf_step", &OptimKernels::rmsprop_tf, false, false, rms_slots);
  bind("bert_adam_step", &OptimKernels::bert_adam, false, false, [](const OptArgs&) { return 3; });
  bind("lamb_stage1", &OptimKernels::lamb_stage1, false, true, [](const OptArgs&) { return 3; });
  bind("lamb_stage2", &OptimKernels::lamb_stage2, false, false, [](const OptArgs&) { return 3; });
  bind("row_dots", &OptimKernels::row_dots, false, true, [](const OptArgs&) { return 0; });
  bind("adamp_stage_a", &OptimKernels::adamp_stage_a, true, true, [](const OptArgs&) { return 3; });
  bind("adamp_stage_b", &OptimKernels::adamp_stage_b, true, false, [](const OptArgs&) { return 3; });
  bind("adagrad_step", &OptimKernels::adagrad, true, false, [](const OptArgs&) { return 1; });

  m.attr("FLAG_NESTEROV") = static_cast<int>(kNesterov);
  m.attr("FLAG_AMSGRAD") = static_cast<int>(kAmsgrad);
  m.attr("FLAG_DECOUPLED") = static_cast<int>(kDecoupled);
  m.attr("FLAG_CENTERED") = static_cast<int>(kCentered);
  m.attr("FLAG_LR_IN_MOMENTUM") = static_cast<int>(kLrInMomentum);
  m.attr("FLAG_NO_BIAS_CORRECTION") = static_cast<int>(kNoBiasCorrection);
  m.attr("FLAG_BIAS_CORRECTION") = static_cast<int>(kBiasCorrection);
  m.attr("FLAG_BETA3") = static_cast<int>(kBeta3);
  m.attr("DTYPE_F32") = static_cast<int>(F32);
  m.attr("DTYPE_F16") = static_cast<int>(F16);
  m.attr("DTYPE_BF16") = static_cast<int>(BF16);
#ifdef APEX_VERSION
  m.attr("__version__") = APEX_VERSION;
#endif
}
