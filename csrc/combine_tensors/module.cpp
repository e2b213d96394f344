// Python bindings of the torch-free core (module `apex_C`).
//
// Two layers:
// * the public functions (scale_, axpy_, copy_, fill_, has_nonfinite, sum_sq,
//   max_abs, segment_sum_sq) take objects that describe their own memory
//   (buffer protocol or DLPack: numpy arrays, torch tensors, ...). Dtype,
//   contiguity, device, sizes, overlap and writability are checked from that
//   description (operands.h) and the objects stay alive for the call; the GIL
//   is released only after every check.
// * the private `_raw_*` functions and the optimizer kernels (OptArgs) take raw
//   (address, element count, dtype code) integers: the fast path apex._core and
//   apex.optimizers use after checking tensors themselves. This layer cannot see
//   how large the memory behind an address is; it rejects everything it can see:
//   counts outside [0, 2^48], null or misaligned addresses, address ranges that
//   wrap, bad dtype codes, partial overlap, and malformed segment tables.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "operands.h"
#include "optim.h"

namespace py = pybind11;
using namespace apexc;

namespace apexc {
// A requested thread count as the public functions take it: any Python int (or object with __index__). Counts are
// requests, capped at run time (resolve_threads), so values outside the C int range saturate instead of failing
// pybind's int conversion, whose TypeError ("incompatible function arguments") says nothing of the range.
struct ThreadCount {
  int n = 0;
  operator int() const { return n; }
};
}  // namespace apexc

namespace pybind11 {
namespace detail {
template <>
struct type_caster<apexc::ThreadCount> {
  PYBIND11_TYPE_CASTER(apexc::ThreadCount, const_name("int"));
  bool load(handle src, bool convert) {
    // an int, or (when converting) anything with __index__; PyNumber_Index gives an exact int for both
    if (!src || !(PyLong_Check(src.ptr()) || (convert && PyIndex_Check(src.ptr())))) return false;
    const auto num = reinterpret_steal<object>(PyNumber_Index(src.ptr()));
    int overflow = 0;
    const long long v = num ? PyLong_AsLongLongAndOverflow(num.ptr(), &overflow) : -1;
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    value.n = (overflow > 0 || v > INT_MAX) ? INT_MAX : (overflow < 0 || v < INT_MIN) ? INT_MIN : static_cast<int>(v);
    return true;
  }
  static handle cast(apexc::ThreadCount t, return_value_policy, handle) { return PyLong_FromLong(t.n); }
};
}  // namespace detail
}  // namespace pybind11

namespace apexc {
std::vector<std::string> supported_levels();
void set_simd_level(const std::string& level);
void init_dispatch();
bool set_flush_denormal(bool on);
}  // namespace apexc

namespace {

// ===========================================================================
// Raw-address validation (the `_raw_*` functions and OptArgs)
// ===========================================================================
std::string msg(const char* what, const std::string& text) { return std::string(what) + ": " + text; }

void check_dtype(int dt, const char* what) {
  if (!valid_dtype(dt))
    throw py::value_error(msg(what, "expected a dtype code 0 (float32), 1 (float16) or 2 (bfloat16), got " +
                                        std::to_string(dt)));
}

void check_count(idx_t n, const char* what) {
  if (n < 0) throw py::value_error(msg(what, "expected a non-negative element count, got " + std::to_string(n)));
  if (n > kMaxElements)
    throw py::value_error(msg(what, "element count " + std::to_string(n) + " exceeds the limit 2**48"));
}

// [addr, addr + n * size) is a plausible buffer: count in range, non-null when
// non-empty, aligned to `size`, and not wrapping around the address space.
// `size` is the bytes per counted item (<= 64), `align` the required alignment (default: size).
void check_span(std::uintptr_t addr, idx_t n, std::size_t size, const char* what, std::size_t align = 0) {
  check_count(n, what);
  if (n > 0 && addr == 0) throw py::value_error(msg(what, "null address for a non-empty buffer"));
  if (align == 0) align = size;
  if (addr % align != 0)
    throw py::value_error(msg(what, "address is not aligned to its element size " + std::to_string(align)));
  // n <= 2^48 and size <= 64: the product cannot overflow
  if (n > 0 && addr > UINTPTR_MAX - static_cast<std::uintptr_t>(n) * size)
    throw py::value_error(msg(what, "address + count * element size wraps around the address space"));
}

void check_buffer(std::uintptr_t ptr, idx_t n, int dt, const char* what) {
  check_dtype(dt, what);
  check_span(ptr, n, dtype_size(dt), what);
}

// Elementwise kernels may run in place (same start, same dtype) but never on
// shifted or differently-typed views of one memory range: the threads would
// read what another already wrote. Both spans were checked by check_buffer.
void check_overlap(std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, const char* what) {
  if (n <= 0) return;
  if (src == dst && sdt == ddt) return;
  if (src == dst) throw py::value_error(msg(what, "an in-place call needs the same dtype on both sides"));
  const std::uintptr_t send = src + static_cast<std::uintptr_t>(n) * dtype_size(sdt);
  const std::uintptr_t dend = dst + static_cast<std::uintptr_t>(n) * dtype_size(ddt);
  if (src < dend && dst < send)
    throw py::value_error(msg(what, "src and dst overlap partially; expected identical or disjoint buffers"));
}

// An offset table of nseg + 1 int64 entries: non-negative, non-decreasing, last
// entry <= 2^48. Returns the last entry (the element count the segments cover).
// nseg itself is checked before the table is read; nseg == 0 reads nothing.
idx_t check_segment_table(const idx_t* s, idx_t nseg, const char* what) {
  if (nseg == 0) return 0;
  if (s[0] < 0) throw py::value_error(msg(what, "segment offsets must be >= 0, got " + std::to_string(s[0])));
  for (idx_t k = 0; k < nseg; ++k)
    if (s[k + 1] < s[k])
      throw py::value_error(msg(what, "segment offsets must be non-decreasing; entry " + std::to_string(k + 1) +
                                          " (" + std::to_string(s[k + 1]) + ") < entry " + std::to_string(k) +
                                          " (" + std::to_string(s[k]) + ")"));
  if (s[nseg] > kMaxElements)
    throw py::value_error(msg(what, "last segment offset " + std::to_string(s[nseg]) + " exceeds the limit 2**48"));
  return s[nseg];
}

void check_raw_segments(std::uintptr_t seg, idx_t nseg, const char* what) {
  check_count(nseg, what);
  if (nseg > 0) check_span(seg, nseg + 1, sizeof(idx_t), what);
}

template <class T>
T* as_ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// ===========================================================================
// Public typed API: checks on Operands (operands.h)
// ===========================================================================
void check_same_count(const Operand& a, const Operand& b, const char* fn) {
  if (a.n != b.n)
    throw py::value_error(std::string(fn) + ": " + b.what() + " has " + std::to_string(b.n) + " elements, " +
                          a.what() + " has " + std::to_string(a.n) + "; expected equal sizes");
}

// One source, one destination of the same size, both of a kernel dtype, no partial overlap.
// One object passed as both (an in-place call) is exported once, as the written operand.
struct SrcDst {
  Operand dst;
  std::optional<Operand> own_src;
  const Operand& src;
  SrcDst(py::handle s, py::handle d, const char* fn, const char* sname, const char* dname)
      : dst(d, Access::kWrite, dname), src(source(s, d, sname)) {
    src.require_float();
    dst.require_float();
    check_same_count(src, dst, fn);
    check_no_partial_overlap(src, dst, fn);
  }

 private:
  const Operand& source(py::handle s, py::handle d, const char* sname) {
    if (s.is(d)) return dst;
    own_src.emplace(s, Access::kRead, sname);
    return *own_src;
  }
};

bool typed_scale(py::handle src, py::handle dst, float scale, bool check, ThreadCount threads) {
  SrcDst o(src, dst, "scale_", "scale_ src", "scale_ dst");
  py::gil_scoped_release nogil;
  return K().scale(o.src.data, o.src.kind, o.dst.data, o.dst.kind, o.src.n, scale, check, threads);
}

bool typed_axpy(py::handle src, py::handle dst, float scale, bool check, ThreadCount threads) {
  SrcDst o(src, dst, "axpy_", "axpy_ src", "axpy_ dst");
  py::gil_scoped_release nogil;
  return K().axpy(o.src.data, o.src.kind, o.dst.data, o.dst.kind, o.src.n, scale, check, threads);
}

void typed_copy(py::handle src, py::handle dst, ThreadCount threads) {
  SrcDst o(src, dst, "copy_", "copy_ src", "copy_ dst");
  if (o.src.begin() == o.dst.begin()) return;  // same buffer, same dtype: nothing to do
  py::gil_scoped_release nogil;
  K().scale(o.src.data, o.src.kind, o.dst.data, o.dst.kind, o.src.n, 1.0f, false, threads);
}

void typed_fill(py::handle dst, float value, ThreadCount threads) {
  Operand d(dst, Access::kWrite, "fill_ dst");
  d.require_float();
  py::gil_scoped_release nogil;
  K().fill(d.data, d.kind, d.n, value, threads);
}

template <class R, class Fn>
R typed_reduce(py::handle src, const char* what, Fn&& fn) {
  Operand s(src, Access::kRead, what);
  s.require_float();
  py::gil_scoped_release nogil;
  return fn(s);
}

void typed_segment_sum_sq(py::handle src, py::handle seg, py::handle out, ThreadCount threads) {
  Operand s(src, Access::kRead, "segment_sum_sq src");
  s.require_float();
  Operand g(seg, Access::kRead, "segment_sum_sq seg");
  g.require_kind(kKindI64);
  Operand o(out, Access::kWrite, "segment_sum_sq out");
  o.require_kind(kKindF64);
  const idx_t nseg = o.n;
  if (!(g.n == nseg + 1 || (nseg == 0 && g.n == 0)))
    throw py::value_error("segment_sum_sq: seg has " + std::to_string(g.n) + " offsets, out has " +
                          std::to_string(nseg) + " entries; expected len(seg) == len(out) + 1");
  check_disjoint(o, s, "segment_sum_sq");
  check_disjoint(o, g, "segment_sum_sq");
  // A private copy of the table: it is validated once and cannot change under the kernel.
  std::vector<idx_t> table(static_cast<const idx_t*>(g.data), static_cast<const idx_t*>(g.data) + g.n);
  const idx_t last = check_segment_table(table.data(), nseg, "segment_sum_sq seg");
  if (last > s.n)
    throw py::value_error("segment_sum_sq: the last offset " + std::to_string(last) + " is past the end of src (" +
                          std::to_string(s.n) + " elements)");
  py::gil_scoped_release nogil;
  K().segment_sum_sq(s.data, s.kind, Segments{table.data(), nseg}, static_cast<double*>(o.data), threads);
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
    if (n > 0 && a.gtab[k] > UINTPTR_MAX - static_cast<std::uintptr_t>(n) * size)
      throw py::value_error("OptArgs.gtab: grad of slot " + std::to_string(k) +
                            ": address + count * element size wraps around the address space");
  }
}

// ===========================================================================
// Optimizer kernels: OptArgs (addresses as ints), validated before every call
// ===========================================================================
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
    if ((a.flags & kF32States) && (a.pdt == F32 || a.gdt != a.pdt || a.out))
      throw py::value_error("OptArgs: FLAG_F32_STATES needs float16/bfloat16 params and grads of the same dtype and "
                            "no out; got param=" + std::to_string(a.pdt) + " grad=" + std::to_string(a.gdt) +
                            " out=" + (a.out ? std::to_string(a.odt) : "none"));
    if (!ok)
      throw py::value_error("OptArgs: unsupported dtype combination param=" + std::to_string(a.pdt) +
                            " grad=" + std::to_string(a.gdt) + " out=" + (a.out ? std::to_string(a.odt) : "none") +
                            "; expected grads in the param dtype, or float32 params with a float16/bfloat16 "
                            "grad/out");
    if (a.nseg < 0) throw py::value_error("OptArgs.nseg must be >= 0, got " + std::to_string(a.nseg));
    check_count(a.nseg, "OptArgs.nseg");
    if (a.nseg > 0 && (!a.p || (!a.g && !a.gtab) || !a.seg))
      throw py::value_error("OptArgs: p, g (or gtab) and seg are required when nseg > 0");
    check_spans();
    if (a.gtab && a.nseg > 0) check_gather_table(a);
    return a;
  }

  // Every address the kernels may dereference, against the extent the segment
  // table gives it: nseg + 1 offsets, per-segment arrays of nseg entries, flat
  // buffers of seg[nseg] elements. Nothing is read when nseg == 0.
  void check_spans() const {
    const idx_t nseg = a.nseg;
    if (nseg == 0) return;
    check_raw_segments(seg, nseg, "OptArgs.seg");
    const idx_t total = check_segment_table(a.seg, nseg, "OptArgs.seg");
    if (a.seg_end) {
      check_span(seg_end, nseg, sizeof(idx_t), "OptArgs.seg_end");
      for (idx_t k = 0; k < nseg; ++k)
        if (a.seg_end[k] < a.seg[k] || a.seg_end[k] > a.seg[k + 1])
          throw py::value_error("OptArgs.seg_end: entry " + std::to_string(k) + " (" + std::to_string(a.seg_end[k]) +
                                ") is outside its slot [" + std::to_string(a.seg[k]) + ", " +
                                std::to_string(a.seg[k + 1]) + "]");
    }
    const std::size_t ps = dtype_size(a.pdt);
    check_span(p, total, ps, "OptArgs.p");
    if (gtab)  // per-slot grad addresses (checked slot by slot in check_gather_table), else the flat buffer
      check_span(gtab, nseg, sizeof(std::uintptr_t), "OptArgs.gtab");
    else
      check_span(g, total, dtype_size(a.gdt), "OptArgs.g");
    const std::size_t ss = (a.flags & kF32States) ? sizeof(float) : ps;  // state element size
    check_span(s0, s0 ? total : 0, ss, "OptArgs.s0");
    check_span(s1, s1 ? total : 0, ss, "OptArgs.s1");
    check_span(s2, s2 ? total : 0, ss, "OptArgs.s2");
    if (out) check_span(out, total, dtype_size(a.odt), "OptArgs.out");
    const std::pair<std::uintptr_t, const char*> f32s[] = {
        {steps, "OptArgs.steps"}, {seg_mul, "OptArgs.seg_mul"}, {seg_gmul, "OptArgs.seg_gmul"},
        {seg_aux, "OptArgs.seg_aux"}};
    for (const auto& f : f32s)
      if (f.first) check_span(f.first, nseg, sizeof(float), f.second);
    if (skip) check_span(skip, nseg, 1, "OptArgs.skip");
    if (first) check_span(first, nseg, 1, "OptArgs.first");
    if (seg_out) check_span(seg_out, nseg, 3 * sizeof(double), "OptArgs.seg_out", sizeof(double));  // <= 3 per segment
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
  if ((a.flags & kF32States) && which != &OptimKernels::adam)
    throw py::value_error(std::string(name) + ": FLAG_F32_STATES (float32 states of fp16/bf16 params) is "
                          "implemented by _raw_adam_step only");
  check_slots(a, slots(a), name);
  if (needs_steps && a.nseg > 0 && !a.steps)
    throw py::value_error(std::string(name) + ": per-segment steps are required");
  if ((a.flags & kBiasCorrection) && a.nseg > 0 && !a.steps)
    throw py::value_error(std::string(name) + ": FLAG_BIAS_CORRECTION needs per-segment steps");
  if (needs_out && a.nseg > 0 && !a.seg_out)
    throw py::value_error(std::string(name) + ": seg_out (per-segment output) is required");
  if (which == &OptimKernels::lamb && (a.flags & kTrustRatio) && a.nseg > 0 && !a.seg_mul)
    throw py::value_error(std::string(name) + ": FLAG_TRUST_RATIO needs seg_mul (the per-segment ratios it writes)");
  if (which == &OptimKernels::adamp_stage_a && a.nseg > 0 && !a.seg_mul)
    throw py::value_error(std::string(name) + ": seg_mul (per-row projection scale) is required");
  OptFn fn = OK().*which;
  py::gil_scoped_release nogil;
  fn(a);
}

}  // namespace

PYBIND11_MODULE(apex_C, m) {
  m.doc() = "apex torch-free kernel core: flat-buffer kernels over host arrays and tensors";
  init_dispatch();

  m.def("supported_simd_levels", &supported_levels, "SIMD levels this CPU and build support, lowest first");
  m.def("simd_level", [] { return std::string(K().name); }, "the SIMD level in use");
  m.def("set_simd_level", &set_simd_level, py::arg("level"),
        "select a SIMD level ('baseline', 'avx2', 'avx512', 'neon' or 'auto'); ValueError if unsupported");
  m.def("_set_flush_denormal", &set_flush_denormal, py::arg("on"),
        "private: the calling thread's flush-denormal mode as torch.set_flush_denormal sets it (x86 DAZ + FTZ, "
        "AArch64 FPCR.FZ); False, changing nothing, where the CPU has none");
  m.def("get_num_threads", &default_threads);
  m.def("set_num_threads", [](ThreadCount n) { set_default_threads(n); }, py::arg("n"),
        "default thread count (<= 0: APEX_NUM_THREADS or all cores)");
  m.def("thread_pool", &thread_pool,
        "whose threads run a threaded call: 'openmp' (the team of the OpenMP runtime in the process, torch's) or "
        "'threads' (threads started per call)");
  m.def("set_thread_pool", &set_thread_pool, py::arg("name"),
        "'auto' (OpenMP when the process has a runtime, else threads; the default, or APEX_THREAD_POOL), 'openmp' "
        "or 'threads'; ValueError if unknown or if 'openmp' has no runtime");

  // NVIDIA's apex_C was a flatten/unflatten helper, and training scripts call it by that name
  // (`apex_C.unflatten(flat, grads)` in BERT pretraining's post-accumulation all-reduce). Both take torch
  // tensors, which this torch-free core never touches: they forward to apex._flatten, imported at the first
  // call (torch with it), so `import apex_C` still needs neither apex nor torch.
  m.def(
      "flatten",
      [](py::object tensors) { return py::module_::import("apex._flatten").attr("flatten")(tensors); },
      py::arg("tensors"),
      "one 1-D tensor holding the given dense tensors' elements one after another (NVIDIA apex_C's flatten; "
      "apex._flatten.flatten)");
  m.def(
      "unflatten",
      [](py::object flat, py::object tensors) {
        return py::module_::import("apex._flatten").attr("unflatten")(flat, tensors);
      },
      py::arg("flat"), py::arg("tensors"),
      "views of the 1-D tensor flat shaped like tensors, consecutive from element 0 (NVIDIA apex_C's unflatten; "
      "apex._flatten.unflatten)");

  // ---- public typed API: objects carrying dtype, shape, device and lifetime ----------------------------
  const char* objs = " Buffers are objects with the buffer protocol or __dlpack__ (numpy arrays, torch tensors): "
                     "C-contiguous, on the CPU, float32/float16/bfloat16.";
  m.def("scale_", &typed_scale, py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("check") = true,
        py::arg("threads") = 0,
        (std::string("dst = src * scale (dtype-converting; dst may be src itself); returns True if any src value "
                     "is inf/nan.") + objs).c_str());
  m.def("axpy_", &typed_axpy, py::arg("src"), py::arg("dst"), py::arg("scale"), py::arg("check") = true,
        py::arg("threads") = 0,
        (std::string("dst += src * scale; returns True if any src value is inf/nan.") + objs).c_str());
  m.def("copy_", &typed_copy, py::arg("src"), py::arg("dst"), py::arg("threads") = 0,
        (std::string("dtype-converting copy of equal-sized buffers (round to nearest even).") + objs).c_str());
  m.def("fill_", &typed_fill, py::arg("dst"), py::arg("value") = 0.0f, py::arg("threads") = 0,
        (std::string("dst[:] = value.") + objs).c_str());
  m.def(
      "has_nonfinite",
      [](py::handle src, ThreadCount threads) {
        return typed_reduce<bool>(src, "has_nonfinite src",
                                  [&](const Operand& s) { return K().has_nonfinite(s.data, s.kind, s.n, threads); });
      },
      py::arg("src"), py::arg("threads") = 0, (std::string("True if any element is inf or nan.") + objs).c_str());
  m.def(
      "sum_sq",
      [](py::handle src, ThreadCount threads) {
        return typed_reduce<double>(src, "sum_sq src",
                                    [&](const Operand& s) { return K().sum_sq(s.data, s.kind, s.n, threads); });
      },
      py::arg("src"), py::arg("threads") = 0,
      (std::string("sum of squares in float64 accumulators; identical for any thread count.") + objs).c_str());
  m.def(
      "max_abs",
      [](py::handle src, ThreadCount threads) {
        return typed_reduce<double>(src, "max_abs src",
                                    [&](const Operand& s) { return K().max_abs(s.data, s.kind, s.n, threads); });
      },
      py::arg("src"), py::arg("threads") = 0, (std::string("max |x| (nan if any nan, 0 if empty).") + objs).c_str());
  m.def("segment_sum_sq", &typed_segment_sum_sq, py::arg("src"), py::arg("seg"), py::arg("out"),
        py::arg("threads") = 0,
        (std::string("out[k] = sum of squares of src[seg[k]:seg[k+1]]: seg int64 with len(out) + 1 non-decreasing "
                     "offsets, out float64 (written).") + objs).c_str());

  // ---- private raw fast path (apex._core, apex.optimizers): (address, count, dtype code) ----------------
  m.def(
      "_raw_scale_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, float scale, bool check, int threads) {
        check_buffer(src, n, sdt, "_raw_scale_ src");
        check_buffer(dst, n, ddt, "_raw_scale_ dst");
        check_overlap(src, sdt, dst, ddt, n, "_raw_scale_");
        py::gil_scoped_release nogil;
        return K().scale(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, scale, check, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("scale"),
      py::arg("check") = true, py::arg("threads") = 0, "private: scale_ on raw addresses");
  m.def(
      "_raw_axpy_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, float scale, bool check, int threads) {
        check_buffer(src, n, sdt, "_raw_axpy_ src");
        check_buffer(dst, n, ddt, "_raw_axpy_ dst");
        check_overlap(src, sdt, dst, ddt, n, "_raw_axpy_");
        py::gil_scoped_release nogil;
        return K().axpy(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, scale, check, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("scale"),
      py::arg("check") = true, py::arg("threads") = 0, "private: axpy_ on raw addresses");
  m.def(
      "_raw_copy_",
      [](std::uintptr_t src, int sdt, std::uintptr_t dst, int ddt, idx_t n, int threads) {
        check_buffer(src, n, sdt, "_raw_copy_ src");
        check_buffer(dst, n, ddt, "_raw_copy_ dst");
        check_overlap(src, sdt, dst, ddt, n, "_raw_copy_");
        if (src == dst) return;
        py::gil_scoped_release nogil;
        K().scale(as_ptr<const void>(src), sdt, as_ptr<void>(dst), ddt, n, 1.0f, false, threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("threads") = 0,
      "private: copy_ on raw addresses");
  m.def(
      "_raw_fill_",
      [](std::uintptr_t dst, int dt, idx_t n, float value, int threads) {
        check_buffer(dst, n, dt, "_raw_fill_");
        py::gil_scoped_release nogil;
        K().fill(as_ptr<void>(dst), dt, n, value, threads);
      },
      py::arg("dst"), py::arg("dtype"), py::arg("n"), py::arg("value") = 0.0f, py::arg("threads") = 0,
      "private: fill_ on a raw address");
  m.def(
      "_raw_has_nonfinite",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "_raw_has_nonfinite");
        py::gil_scoped_release nogil;
        return K().has_nonfinite(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0,
      "private: has_nonfinite on a raw address");
  m.def(
      "_raw_sum_sq",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "_raw_sum_sq");
        py::gil_scoped_release nogil;
        return K().sum_sq(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0, "private: sum_sq on a raw address");
  m.def(
      "_raw_max_abs",
      [](std::uintptr_t src, int dt, idx_t n, int threads) {
        check_buffer(src, n, dt, "_raw_max_abs");
        py::gil_scoped_release nogil;
        return K().max_abs(as_ptr<const void>(src), dt, n, threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("threads") = 0, "private: max_abs on a raw address");
  m.def(
      "_raw_segment_sum_sq",
      [](std::uintptr_t src, int dt, std::uintptr_t seg, idx_t nseg, std::uintptr_t out, int threads) {
        check_dtype(dt, "_raw_segment_sum_sq");
        check_raw_segments(seg, nseg, "_raw_segment_sum_sq seg");
        check_span(out, nseg, sizeof(double), "_raw_segment_sum_sq out");
        if (nseg == 0) return;
        const idx_t* s = as_ptr<const idx_t>(seg);
        const idx_t total = check_segment_table(s, nseg, "_raw_segment_sum_sq seg");
        check_span(src, total, dtype_size(dt), "_raw_segment_sum_sq src");
        const std::uintptr_t out_end = out + static_cast<std::uintptr_t>(nseg) * sizeof(double);
        const std::uintptr_t seg_bytes = static_cast<std::uintptr_t>(nseg + 1) * sizeof(idx_t);
        const std::uintptr_t src_bytes = static_cast<std::uintptr_t>(total) * dtype_size(dt);
        if ((out < seg + seg_bytes && seg < out_end) || (total > 0 && out < src + src_bytes && src < out_end))
          throw py::value_error("_raw_segment_sum_sq: out shares memory with seg or src; expected disjoint buffers");
        py::gil_scoped_release nogil;
        K().segment_sum_sq(as_ptr<const void>(src), dt, Segments{s, nseg}, as_ptr<double>(out), threads);
      },
      py::arg("src"), py::arg("dtype"), py::arg("seg"), py::arg("nseg"), py::arg("out"), py::arg("threads") = 0,
      "private: segment_sum_sq on raw addresses (nseg+1 int64 offsets, nseg float64 outputs)");
  m.def(
      "_split_range",
      [](idx_t n, int threads, idx_t min_per, idx_t align) {
        if (threads > 4096) throw py::value_error("_split_range: at most 4096 threads");
        const Split sp = split_range(n, threads, min_per, align);
        std::vector<std::pair<idx_t, idx_t>> out;
        for (int t = 0; t < sp.parts; ++t) out.emplace_back(sp.per * t, step_to(sp.per * t, sp.per, n));
        return out;
      },
      py::arg("n"), py::arg("threads"), py::arg("min_per"), py::arg("align"),
      "private: the (begin, end) ranges the kernels' thread split gives n elements (for tests)");

  m.def(
      "_raw_scale_gather_",
      [](std::uintptr_t addr, std::uintptr_t numel, idx_t n, int dt, float scale, bool check, int threads) {
        check_dtype(dt, "_raw_scale_gather_");
        if (n < 0) throw py::value_error("_raw_scale_gather_: n must be >= 0, got " + std::to_string(n));
        if (n > 0 && (!addr || !numel)) throw py::value_error("_raw_scale_gather_: addr and numel tables are required");
        check_count(n, "_raw_scale_gather_ n");
        check_span(addr, n, sizeof(std::uintptr_t), "_raw_scale_gather_ addr table");
        check_span(numel, n, sizeof(idx_t), "_raw_scale_gather_ numel table");
        const std::uintptr_t* ad = as_ptr<const std::uintptr_t>(addr);
        const idx_t* nu = as_ptr<const idx_t>(numel);
        const std::size_t size = dtype_size(dt);
        idx_t total = 0;
        for (idx_t j = 0; j < n; ++j) {  // message built only on failure: this runs once per grad per step
          const idx_t c = nu[j];
          if (c < 0 || c > kMaxElements || (c > 0 && ad[j] == 0) || ad[j] % size != 0 ||
              (c > 0 && ad[j] > UINTPTR_MAX - static_cast<std::uintptr_t>(c) * size))
            check_buffer(ad[j], c, dt, ("_raw_scale_gather_ buffer " + std::to_string(j)).c_str());
          total += c;  // each c <= 2^48: no overflow before the check below trips
          if (total > kMaxElements)
            throw py::value_error("_raw_scale_gather_: the buffers hold more than 2**48 elements in all");
        }
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
  bind("_raw_sgd_step", &OptimKernels::sgd, false, false, [](const OptArgs& a) { return a.hp[1] != 0.0 ? 1 : 0; });
  bind("_raw_adam_step", &OptimKernels::adam, true, false,
       [](const OptArgs& a) { return (a.flags & kAmsgrad) ? 7 : 3; });
  bind("_raw_adadelta_step", &OptimKernels::adadelta, false, false, [](const OptArgs&) { return 3; });
  auto rms_slots = [](const OptArgs& a) { return 1 | (a.hp[4] > 0.0 ? 2 : 0) | ((a.flags & kCentered) ? 4 : 0); };
  bind("_raw_rmsprop_step", &OptimKernels::rmsprop, false, false, rms_slots);
  bind("_raw_rmsprop_tf_step", &OptimKernels::rmsprop_tf, false, false, rms_slots);
  bind("_raw_bert_adam_step", &OptimKernels::bert_adam, false, false, [](const OptArgs&) { return 3; });
  bind("_raw_lamb_stage1", &OptimKernels::lamb_stage1, false, true, [](const OptArgs&) { return 3; });
  bind("_raw_lamb_stage2", &OptimKernels::lamb_stage2, false, false, [](const OptArgs&) { return 3; });
  bind("_raw_lamb_step", &OptimKernels::lamb, false, true, [](const OptArgs&) { return 3; });
  bind("_raw_row_dots", &OptimKernels::row_dots, false, true, [](const OptArgs&) { return 0; });
  bind("_raw_grad_sum_sq", &OptimKernels::grad_sum_sq, false, true, [](const OptArgs&) { return 0; });
  bind("_raw_adamp_stage_a", &OptimKernels::adamp_stage_a, true, true, [](const OptArgs&) { return 3; });
  bind("_raw_adamp_stage_b", &OptimKernels::adamp_stage_b, true, false, [](const OptArgs&) { return 3; });
  bind("_raw_adagrad_step", &OptimKernels::adagrad, true, false, [](const OptArgs&) { return 1; });

  // The compiler that built this module: its vectoriser shapes every kernel loop (the bench records it).
#if defined(__clang__)
  m.attr("compiler") = "clang " __clang_version__;
#elif defined(__GNUC__)
  m.attr("compiler") = "gcc " __VERSION__;
#else
  m.attr("compiler") = "unknown";
#endif
  m.attr("FLAG_NESTEROV") = static_cast<int>(kNesterov);
  m.attr("FLAG_AMSGRAD") = static_cast<int>(kAmsgrad);
  m.attr("FLAG_DECOUPLED") = static_cast<int>(kDecoupled);
  m.attr("FLAG_CENTERED") = static_cast<int>(kCentered);
  m.attr("FLAG_LR_IN_MOMENTUM") = static_cast<int>(kLrInMomentum);
  m.attr("FLAG_NO_BIAS_CORRECTION") = static_cast<int>(kNoBiasCorrection);
  m.attr("FLAG_BIAS_CORRECTION") = static_cast<int>(kBiasCorrection);
  m.attr("FLAG_BETA3") = static_cast<int>(kBeta3);
  m.attr("FLAG_F32_STATES") = static_cast<int>(kF32States);
  m.attr("FLAG_TRUST_RATIO") = static_cast<int>(kTrustRatio);
  m.attr("FLAG_CLAMP_WEIGHT_NORM") = static_cast<int>(kClampWeightNorm);
  m.attr("DTYPE_F32") = static_cast<int>(F32);
  m.attr("DTYPE_F16") = static_cast<int>(F16);
  m.attr("DTYPE_BF16") = static_cast<int>(BF16);
#ifdef APEX_VERSION
  m.attr("__version__") = APEX_VERSION;
#endif
}
