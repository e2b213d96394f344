// Typed buffer operands of the public apex_C functions.
//
// A public function receives Python objects that describe their own memory
// (numpy arrays, torch tensors, array.array, memoryview, ...) instead of raw
// addresses. `Operand` reads that description through the buffer protocol or
// DLPack, checks it (dtype, C-contiguity, CPU device, writability, extent) and
// keeps the producer's memory alive until the Operand is destroyed. Kernels run
// on `data`/`n` only after every operand of a call has been checked.
//
// The DLPack structures below are written from the DLPack specification
// (dlpack.h v1.x and the Python exchange protocol): a producer's
// `__dlpack__()` returns a PyCapsule named "dltensor" (legacy DLManagedTensor)
// or "dltensor_versioned" (DLManagedTensorVersioned, when the consumer passes
// max_version). The consumer renames the capsule to "used_dltensor" /
// "used_dltensor_versioned" once it owns the tensor, and calls the tensor's
// deleter when done; a capsule that keeps its original name is cleaned up by the
// producer's capsule destructor instead.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"

namespace apexc {
namespace dlpack {

enum : std::int32_t { kDLCPU = 1 };
enum : std::uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4 };

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null = compact row-major
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  std::uint64_t flags;
  DLTensor dl_tensor;
};
constexpr std::uint64_t kFlagReadOnly = 1u << 0;
constexpr std::uint64_t kFlagIsCopied = 1u << 1;
constexpr std::uint32_t kMajorVersion = 1;

}  // namespace dlpack

// Element kinds an operand may hold: the kernel dtypes (same codes as DType)
// plus the float64 outputs and int64 offset tables some functions take.
enum Kind : int { kKindF32 = F32, kKindF16 = F16, kKindBF16 = BF16, kKindF64 = 10, kKindI64 = 11, kKindOther = -1 };

inline const char* kind_name(int k) {
  switch (k) {
    case kKindF32: return "float32";
    case kKindF16: return "float16";
    case kKindBF16: return "bfloat16";
    case kKindF64: return "float64";
    case kKindI64: return "int64";
    default: return "an unsupported element type";
  }
}
inline std::size_t kind_size(int k) { return k == kKindF64 || k == kKindI64 ? 8 : k == kKindF32 ? 4 : 2; }

enum class Access { kRead, kWrite };

class Operand {
 public:
  // `what` names the argument in error messages ("scale_ dst").
  Operand(pybind11::handle obj, Access access, const char* what) : what_(what) {
    namespace py = pybind11;
    if (PyObject_CheckBuffer(obj.ptr())) {
      from_buffer(obj, access);
    } else if (py::hasattr(obj, "__dlpack__")) {
      from_dlpack(obj, access);
    } else {
      fail<py::type_error>(std::string("expected an array or tensor that exports the buffer protocol or __dlpack__ "
                                       "(numpy array, torch tensor, array.array, memoryview), got ") +
                           Py_TYPE(obj.ptr())->tp_name +
                           (PyLong_Check(obj.ptr()) ? "; raw addresses are not accepted here" : ""));
    }
  }
  Operand(const Operand&) = delete;
  Operand& operator=(const Operand&) = delete;
  // Runs with the GIL held: bindings destroy operands after the GIL-free kernel scope ends.
  ~Operand() { release(); }

  void* data = nullptr;  // first element
  idx_t n = 0;           // element count (<= kMaxElements)
  int kind = kKindOther;

  std::uintptr_t begin() const { return reinterpret_cast<std::uintptr_t>(data); }
  std::uintptr_t end() const { return begin() + static_cast<std::uintptr_t>(n) * kind_size(kind); }

  // ValueError/TypeError unless the element kind is one of the kernel dtypes.
  void require_float() const {
    if (!valid_dtype(kind))
      fail<pybind11::type_error>(std::string("expected float32, float16 or bfloat16 elements, got ") + got_);
  }
  void require_kind(int k) const {
    if (kind != k)
      fail<pybind11::type_error>(std::string("expected ") + kind_name(k) + " elements, got " + got_);
  }
  const char* what() const { return what_; }

  template <class E>
  [[noreturn]] void fail(const std::string& msg) const {
    throw E(std::string(what_) + ": " + msg);
  }

 private:
  const char* what_;
  std::string got_;  // the element type as the producer described it, for messages
  Py_buffer view_{};
  bool has_view_ = false;
  dlpack::DLManagedTensor* legacy_ = nullptr;
  dlpack::DLManagedTensorVersioned* versioned_ = nullptr;

  void release() {
    if (has_view_) {
      PyBuffer_Release(&view_);
      has_view_ = false;
    }
    if (legacy_) {
      if (legacy_->deleter) legacy_->deleter(legacy_);
      legacy_ = nullptr;
    }
    if (versioned_) {
      if (versioned_->deleter) versioned_->deleter(versioned_);
      versioned_ = nullptr;
    }
  }

  // A constructor that throws never runs the destructor: release what was taken first.
  template <class E>
  [[noreturn]] void abandon(const std::string& msg) {
    release();
    fail<E>(msg);
  }

  void finish(std::uintptr_t addr, idx_t count, int k) {
    const std::size_t size = kind_size(k);
    if (count > kMaxElements)
      abandon<pybind11::value_error>("has " + std::to_string(count) + " elements; at most 2**48 are supported");
    if (count > 0 && addr == 0) abandon<pybind11::value_error>("null data pointer for a non-empty buffer");
    if (addr % size != 0)
      abandon<pybind11::value_error>("data address is not aligned to its element size " + std::to_string(size));
    if (count > 0 && addr > UINTPTR_MAX - static_cast<std::uintptr_t>(count) * size)
      abandon<pybind11::value_error>("address range wraps around the address space");
    data = reinterpret_cast<void*>(addr);
    n = count;
    kind = k;
  }

  void from_buffer(pybind11::handle obj, Access access) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_RECORDS_RO) != 0) throw pybind11::error_already_set();
    has_view_ = true;
    const char* f = view_.format ? view_.format : "B";
    got_ = std::string("buffer format '") + f + "' (itemsize " + std::to_string(view_.itemsize) + ")";
    const std::uint16_t probe = 1;
    const bool little = *reinterpret_cast<const std::uint8_t*>(&probe) == 1;
    if (*f == '@' || *f == '=' || (*f == '<' && little) || (*f == '>' && !little) || (*f == '!' && !little)) ++f;
    int k = kKindOther;
    if (f[0] != '\0' && f[1] == '\0') {
      switch (f[0]) {
        case 'f': k = view_.itemsize == 4 ? kKindF32 : kKindOther; break;
        case 'e': k = view_.itemsize == 2 ? kKindF16 : kKindOther; break;
        case 'd': k = view_.itemsize == 8 ? kKindF64 : kKindOther; break;
        case 'q':
        case 'l': k = view_.itemsize == 8 ? kKindI64 : kKindOther; break;
        default: break;
      }
    }
    if (k == kKindOther) return;  // the caller's require_* names what was expected
    if (!PyBuffer_IsContiguous(&view_, 'C'))
      abandon<pybind11::value_error>("expected a C-contiguous buffer, got a strided view (make a contiguous copy)");
    if (access == Access::kWrite && view_.readonly)
      abandon<pybind11::value_error>("is written but the buffer is read-only");
    if (view_.len < 0 || view_.len % view_.itemsize != 0)
      abandon<pybind11::value_error>("buffer length is not a multiple of its item size");
    finish(reinterpret_cast<std::uintptr_t>(view_.buf), static_cast<idx_t>(view_.len / view_.itemsize), k);
  }

  void from_dlpack(pybind11::handle obj, Access access) {
    namespace py = pybind11;
    using namespace dlpack;
    if (py::hasattr(obj, "__dlpack_device__")) {
      py::object dev = obj.attr("__dlpack_device__")();
      if (!PyTuple_Check(dev.ptr()) || PyTuple_GET_SIZE(dev.ptr()) != 2 || !PyLong_Check(PyTuple_GET_ITEM(dev.ptr(), 0)))
        fail<py::type_error>("__dlpack_device__() must return a tuple (device_type, device_id)");
      const long type = PyLong_AsLong(PyTuple_GET_ITEM(dev.ptr(), 0));  // IntEnum members are ints
      if (type == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (type != kDLCPU)
        fail<py::value_error>("expected a CPU tensor (DLPack device type 1), got device type " +
                              std::to_string(type) + "; move it to the CPU first");
    }
    // torch's lazy negation (x.conj().imag, torch._neg_view): the memory holds the negated values, which DLPack
    // cannot say, so such a tensor would be read (or written) with the wrong sign
    if (py::hasattr(obj, "is_neg")) {
      py::object neg = obj.attr("is_neg")();
      const int set = PyObject_IsTrue(neg.ptr());
      if (set < 0) throw py::error_already_set();
      if (set)
        fail<py::value_error>("a tensor with torch's lazy negation bit (e.g. from .conj().imag) holds the negated "
                              "values in memory; pass t.resolve_neg()");
    }
    py::object cap;
    try {
      cap = obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(kMajorVersion, 0));
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_TypeError)) throw;  // producers older than DLPack 1.0 reject max_version
      cap = obj.attr("__dlpack__")();
    }
    if (!PyCapsule_CheckExact(cap.ptr()))
      fail<py::type_error>(std::string("__dlpack__() must return a PyCapsule, got ") + Py_TYPE(cap.ptr())->tp_name);
    const DLTensor* t = nullptr;
    std::uint64_t flags = 0;
    if (PyCapsule_IsValid(cap.ptr(), "dltensor_versioned")) {
      auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap.ptr(), "dltensor_versioned"));
      if (PyCapsule_SetName(cap.ptr(), "used_dltensor_versioned") != 0) throw py::error_already_set();
      versioned_ = m;  // owned from here on: the deleter runs in release()
      if (m->version.major != kMajorVersion)
        abandon<py::value_error>("DLPack major version " + std::to_string(m->version.major) +
                                 " is not supported (expected " + std::to_string(kMajorVersion) + ")");
      t = &m->dl_tensor;
      flags = m->flags;
    } else if (PyCapsule_IsValid(cap.ptr(), "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
      if (PyCapsule_SetName(cap.ptr(), "used_dltensor") != 0) throw py::error_already_set();
      legacy_ = m;
      t = &m->dl_tensor;
    } else {
      const char* name = PyCapsule_GetName(cap.ptr());
      PyErr_Clear();
      fail<py::type_error>(std::string("__dlpack__() returned a capsule named '") + (name ? name : "") +
                           "', expected an unconsumed 'dltensor' or 'dltensor_versioned'");
    }
    if (t->device.device_type != kDLCPU)
      abandon<py::value_error>("expected a CPU tensor (DLPack device type 1), got device type " +
                               std::to_string(t->device.device_type));
    const DLDataType dt = t->dtype;
    got_ = "DLPack dtype (code " + std::to_string(dt.code) + ", bits " + std::to_string(dt.bits) + ", lanes " +
           std::to_string(dt.lanes) + ")";
    int k = kKindOther;
    if (dt.lanes == 1) {
      if (dt.code == kDLFloat && dt.bits == 32) k = kKindF32;
      else if (dt.code == kDLFloat && dt.bits == 16) k = kKindF16;
      else if (dt.code == kDLBfloat && dt.bits == 16) k = kKindBF16;
      else if (dt.code == kDLFloat && dt.bits == 64) k = kKindF64;
      else if (dt.code == kDLInt && dt.bits == 64) k = kKindI64;
    }
    if (k == kKindOther) return;
    if (access == Access::kWrite && (flags & kFlagReadOnly))
      abandon<py::value_error>("is written but the tensor is read-only (DLPack READ_ONLY flag)");
    if (access == Access::kWrite && (flags & kFlagIsCopied))
      abandon<py::value_error>("is written but the producer exported a copy (DLPack IS_COPIED flag)");
    if (t->ndim < 0 || t->ndim > 64)
      abandon<py::value_error>("DLPack ndim " + std::to_string(t->ndim) + " out of range");
    if (t->ndim > 0 && !t->shape) abandon<py::value_error>("DLPack shape is null");
    idx_t count = 1;
    for (std::int32_t d = 0; d < t->ndim; ++d) {
      if (t->shape[d] < 0) abandon<py::value_error>("DLPack shape has a negative extent");
      if (!checked_mul(count, t->shape[d], &count) || count > kMaxElements)
        count = kMaxElements + 1;  // reported by finish()
    }
    if (t->strides && count > 0 && count <= kMaxElements) {
      idx_t expect = 1;
      for (std::int32_t d = t->ndim - 1; d >= 0; --d) {
        if (t->shape[d] != 1 && t->strides[d] != expect)
          abandon<py::value_error>("expected a C-contiguous tensor, got strides that are not row-major compact "
                                   "(call .contiguous() first)");
        expect *= t->shape[d];
      }
    }
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(t->data);
    if (t->byte_offset > UINTPTR_MAX - base) abandon<py::value_error>("DLPack byte_offset wraps the address space");
    finish(base + static_cast<std::uintptr_t>(t->byte_offset), count, k);
  }
};

// Elementwise kernels may run in place (same start, same dtype, same length) but
// never on shifted or differently-typed views of one memory range: the threads
// would read what another already wrote.
inline void check_no_partial_overlap(const Operand& src, const Operand& dst, const char* fn) {
  if (src.n == 0 || dst.n == 0) return;
  if (src.begin() == dst.begin() && src.kind == dst.kind && src.n == dst.n) return;
  if (src.begin() == dst.begin())
    throw pybind11::value_error(std::string(fn) + ": an in-place call needs the same dtype on both sides");
  if (src.begin() < dst.end() && dst.begin() < src.end())
    throw pybind11::value_error(std::string(fn) + ": " + src.what() + " and " + dst.what() +
                                " overlap partially; expected identical or disjoint buffers");
}

// Read-only inputs may share memory with each other; a written operand must share none with any other.
inline void check_disjoint(const Operand& a, const Operand& b, const char* fn) {
  if (a.n == 0 || b.n == 0) return;
  if (a.begin() < b.end() && b.begin() < a.end())
    throw pybind11::value_error(std::string(fn) + ": " + a.what() + " and " + b.what() +
                                " share memory; expected disjoint buffers");
}

}  // namespace apexc
