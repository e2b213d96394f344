// An emulated "npu" device for tests: PyTorch's PrivateUse1 backend over host memory.
//
// Tensors of this device live in ordinary host memory, but they carry the npu device type, so every line of
// device-generic code (dispatch on device type, autocast for "npu", dtype handling, copies between devices) runs
// as it would on a real accelerator. Operators without an explicit kernel here go through one boxed fallback: the
// npu arguments are re-viewed as CPU tensors over the same memory, the CPU kernel runs, and its results are handed
// back as npu tensors (views keep sharing the npu storage, fresh results are adopted without a copy).
//
// The fallback also emulates the Ascend float-status register: a floating result holding inf/nan raises a global
// overflow flag. In saturation mode (older chips) such values are additionally clamped to the finite range, so the
// flag is the only way to see the overflow, as on that hardware.
//
// Python reaches the emulator's own controls as torch.ops.npu_emu.* (no Python headers: torch.ops.load_library).

#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/all.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/nan_to_num.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <vector>

namespace npu_emu {
namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kDeviceCount = 2;

thread_local c10::DeviceIndex current_device = 0;

// ------------------------------------------------------------------------------------------------ memory statistics

struct DeviceStats {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
};
std::array<DeviceStats, kDeviceCount> stats;

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < kDeviceCount, "npu emulator: device index must be in [0, ", int(kDeviceCount),
              "), got ", int(index));
}

void count_alloc(c10::DeviceIndex dev, int64_t bytes) {
  auto& s = stats[dev];
  int64_t now = s.allocated.fetch_add(bytes) + bytes;
  s.allocations.fetch_add(1);
  int64_t peak = s.peak.load();
  while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
  }
}

// ------------------------------------------------------------------------------------------------ allocator

struct Block {
  void* ptr;
  int64_t bytes;
  c10::DeviceIndex dev;
};

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  stats[b->dev].allocated.fetch_sub(b->bytes);
  c10::free_cpu(b->ptr);
  delete b;
}

struct NpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex dev = current_device;
    const c10::Device device(kNpu, dev);
    if (nbytes == 0) {
      return {nullptr, nullptr, nullptr, device};
    }
    void* ptr = c10::alloc_cpu(nbytes);
    count_alloc(dev, static_cast<int64_t>(nbytes));
    return {ptr, new Block{ptr, static_cast<int64_t>(nbytes), dev}, &free_block, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
NpuAllocator allocator;

// Memory handed over from a CPU result: the npu storage keeps the CPU storage alive (no copy).
void release_cpu_storage(void* ctx) {
  delete static_cast<c10::Storage*>(ctx);
}

// ------------------------------------------------------------------------------------------------ device guard

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    if (old.index() != d.index()) {
      setDevice(d);
    }
    return old;
  }
  c10::Device getDevice() const override { return {kNpu, current_device}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kNpu, "npu emulator: expected an npu device, got ", d);
    check_index(d.index());
    current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kDeviceCount) {
      current_device = d.index();
    }
  }
  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return kDeviceCount; }
  // Everything runs synchronously on the host: events and streams are always complete.
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

// ------------------------------------------------------------------------------------------------ hooks

void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "npu emulator: trying to resize a storage that is not resizable");
  c10::DeviceGuard guard(impl->device());
  c10::DataPtr fresh = allocator.allocate(newsize);
  const size_t keep = std::min(newsize, impl->nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), impl->data(), keep);
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  // Random numbers on the emulated device come from the CPU generator (the fallback runs CPU kernels).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  at::Device getDeviceFromPtr(void*) const override { return {kNpu, current_device}; }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDeviceCount; }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_index(d);
    current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = current_device;
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

// ------------------------------------------------------------------------------------------------ overflow flag

std::atomic<bool> overflow_flag{false};
std::atomic<bool> saturation_mode{false};
std::atomic<bool> overflow_check{true};
std::atomic<int64_t> fallback_calls{0};

// ------------------------------------------------------------------------------------------------ npu <-> cpu views

c10::Storage cpu_alias_storage(const c10::Storage& npu) {
  // Same bytes, CPU device, not owning them. Resizable through the CPU allocator: a kernel that grows an output
  // gets fresh host memory, which the fallback then moves into the npu storage.
  c10::DataPtr view(npu.mutable_data(), c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::Storage::use_byte_size_t(), npu.nbytes(), std::move(view), c10::GetCPUAllocator(),
                      /*resizable=*/true);
}

at::Tensor tensor_on(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return t;
}

bool is_npu(const at::Tensor& t) {
  return t.defined() && t.device().type() == kNpu;
}

// One fallback call: the CPU aliases made for the npu arguments and how to map results back.
struct Call {
  std::unordered_map<c10::StorageImpl*, c10::Storage> alias_of_npu;    // npu storage -> its CPU alias
  std::unordered_map<c10::StorageImpl*, c10::Storage> npu_of_alias;    // CPU alias storage -> npu storage
  std::unordered_map<c10::TensorImpl*, at::Tensor> npu_of_alias_tensor;  // CPU alias tensor -> npu tensor
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;                   // (npu tensor, CPU alias) of the inputs
  c10::optional<c10::Device> device;

  c10::Storage alias(const c10::Storage& npu) {
    auto found = alias_of_npu.find(npu.unsafeGetStorageImpl());
    if (found != alias_of_npu.end()) {
      return found->second;
    }
    c10::Storage cpu = cpu_alias_storage(npu);
    alias_of_npu.emplace(npu.unsafeGetStorageImpl(), cpu);
    npu_of_alias.emplace(cpu.unsafeGetStorageImpl(), npu);
    return cpu;
  }

  at::Tensor to_cpu(const at::Tensor& t) {
    if (!is_npu(t)) {
      return t;
    }
    if (!device) {
      device = t.device();
    }
    at::Tensor cpu = tensor_on(alias(t.storage()), c10::DispatchKey::CPU, t);
    npu_of_alias_tensor.emplace(cpu.unsafeGetTensorImpl(), t);
    pairs.emplace_back(t, cpu);
    return cpu;
  }

  c10::IValue to_cpu(const c10::IValue& v) {
    if (v.isTensor()) {
      return to_cpu(v.toTensor());
    }
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        out.push_back(to_cpu(t));
      }
      return out;
    }
    if (v.isList()) {  // Tensor?[] (index) and other lists
      auto list = v.toList();
      if (list.elementType()->kind() == c10::TypeKind::OptionalType) {
        c10::List<c10::optional<at::Tensor>> out;
        for (const c10::IValue& e : list) {
          out.push_back(e.isTensor() ? c10::optional<at::Tensor>(to_cpu(e.toTensor())) : c10::nullopt);
        }
        return out;
      }
      return v;
    }
    if (v.isDevice() && v.toDevice().type() == kNpu) {
      if (!device) {
        device = v.toDevice();
      }
      return c10::Device(c10::DeviceType::CPU);
    }
    if (v.isStorage() && v.toStorage().device_type() == kNpu) {
      return alias(v.toStorage());
    }
    return v;
  }

  c10::Device out_device() const {
    if (device && device->has_index()) {
      return *device;
    }
    return {kNpu, current_device};
  }

  // The npu storage for a CPU storage a kernel produced or left in a tensor.
  c10::Storage npu_storage(const c10::Storage& cpu) {
    auto found = npu_of_alias.find(cpu.unsafeGetStorageImpl());
    if (found != npu_of_alias.end()) {
      c10::Storage npu = found->second;
      c10::StorageImpl* alias_impl = cpu.unsafeGetStorageImpl();
      if (alias_impl->data() != npu.data() || alias_impl->nbytes() != npu.nbytes()) {
        // The kernel resized the alias: take over its new memory.
        c10::DataPtr moved = alias_impl->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU)));
        moved.unsafe_set_device(npu.device());
        npu.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(moved));
        npu.unsafeGetStorageImpl()->set_nbytes(alias_impl->nbytes());
        // The alias keeps viewing the (now npu-owned) memory, for later results of this call.
        alias_impl->set_data_ptr_noswap(c10::DataPtr(npu.mutable_data(), c10::Device(c10::DeviceType::CPU)));
      }
      return npu;
    }
    const c10::Device dev = out_device();
    auto* keep = new c10::Storage(cpu);
    c10::DataPtr adopted(cpu.mutable_data(), keep, &release_cpu_storage, dev);
    c10::Storage npu(c10::Storage::use_byte_size_t(), cpu.nbytes(), std::move(adopted), &allocator,
                     /*resizable=*/true);
    npu_of_alias.emplace(cpu.unsafeGetStorageImpl(), npu);
    return npu;
  }

  // A result of the CPU kernel as an npu tensor: inputs returned as themselves, views on the input's storage.
  at::Tensor to_npu(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU) {
      return t;
    }
    auto same = npu_of_alias_tensor.find(t.unsafeGetTensorImpl());
    if (same != npu_of_alias_tensor.end()) {
      return same->second;
    }
    return tensor_on(npu_storage(t.storage()), c10::DispatchKey::PrivateUse1, t);
  }

  c10::IValue to_npu(const c10::IValue& v) {
    if (v.isTensor()) {
      return to_npu(v.toTensor());
    }
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        out.push_back(to_npu(t));
      }
      return out;
    }
    return v;
  }

  // In-place and out= kernels may have changed an input's storage or shape: mirror that on the npu tensor.
  void sync_inputs() {
    for (auto& [npu, cpu] : pairs) {
      c10::Storage storage = npu_storage(cpu.storage());
      c10::TensorImpl* impl = npu.unsafeGetTensorImpl();
      if (npu.storage().unsafeGetStorageImpl() != storage.unsafeGetStorageImpl()) {
        impl->set_storage_keep_dtype(storage);
      }
      if (npu.sizes() != cpu.sizes() || npu.strides() != cpu.strides() ||
          npu.storage_offset() != cpu.storage_offset()) {
        impl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
      }
    }
  }
};

// Floating values of a kernel's result: raise the overflow flag on inf/nan; saturate them in saturation mode.
void check_overflow(const at::Tensor& cpu) {
  if (!cpu.defined() || !c10::isFloatingType(cpu.scalar_type()) || cpu.numel() == 0) {
    return;
  }
  if (at::isfinite(cpu).all().item<bool>()) {
    return;
  }
  overflow_flag.store(true);
  if (saturation_mode.load()) {
    cpu.nan_to_num_(0.0);  // +-inf -> the dtype's largest finite values, nan -> 0
  }
}

void check_overflow(const c10::IValue& v) {
  if (v.isTensor()) {
    check_overflow(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      check_overflow(t);
    }
  }
}

void run_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool check) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t num_rets = schema.returns().size();

  Call call;
  std::vector<c10::IValue> args;
  std::vector<c10::IValue> written;  // CPU aliases of the arguments the kernel writes (in-place, out=)
  args.reserve(num_args);
  size_t i = 0;
  for (const c10::IValue& v : torch::jit::last(*stack, num_args)) {
    args.push_back(call.to_cpu(v));
    const auto* info = schema.arguments()[i++].alias_info();
    if (info != nullptr && info->isWrite()) {
      written.push_back(args.back());
    }
  }
  torch::jit::drop(*stack, num_args);
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    for (auto& v : args) {
      stack->push_back(std::move(v));
    }
    op.callBoxed(stack);
  }

  if (check && overflow_check.load()) {
    // Written arguments and fresh results; not views (a view's values were checked when they were produced).
    for (const auto& v : written) {
      check_overflow(v);
    }
    auto rets = torch::jit::last(*stack, num_rets);
    for (size_t r = 0; r < num_rets; ++r) {
      if (schema.returns()[r].alias_info() == nullptr) {
        check_overflow(rets[r]);
      }
    }
  }

  call.sync_inputs();
  for (size_t r = stack->size() - num_rets; r < stack->size(); ++r) {
    (*stack)[r] = call.to_npu((*stack)[r]);
  }
}

void npu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  fallback_calls.fetch_add(1);
  run_on_cpu(op, stack, /*check=*/true);
}

// Collectives (c10d::allreduce_, ...) on npu tensors run the process group's CPU backend (gloo) over the same
// memory: the emulated device has no communication library of its own. Moving data is not arithmetic, so the
// overflow flag is left alone.
void npu_collective(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_on_cpu(op, stack, /*check=*/false);
}

// ------------------------------------------------------------------------------------------------ explicit kernels

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  const c10::Device dev = device.value_or(c10::Device(kNpu, current_device));
  c10::DeviceGuard guard(dev.has_index() ? dev : c10::Device(kNpu, current_device));
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "npu emulator: only strided tensors");
  return at::detail::empty_generic(size, &allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  const c10::Device dev = device.value_or(c10::Device(kNpu, current_device));
  c10::DeviceGuard guard(dev.has_index() ? dev : c10::Device(kNpu, current_device));
  TORCH_CHECK(layout.value_or(at::kStrided) == at::kStrided, "npu emulator: only strided tensors");
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_cpu(const at::Tensor& t) {
  return is_npu(t) ? tensor_on(cpu_alias_storage(t.storage()), c10::DispatchKey::CPU, t) : t;
}

// Copies between cpu and npu, or npu and npu (any devices): a CPU copy over the same memory, so dtype conversion,
// broadcasting and strides behave as torch's copy_ does.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.device().type() == kNpu || self.device().type() == c10::DeviceType::CPU,
              "npu emulator: copy from ", self.device(), " is not supported");
  TORCH_CHECK(dst.device().type() == kNpu || dst.device().type() == c10::DeviceType::CPU,
              "npu emulator: copy to ", dst.device(), " is not supported");
  at::Tensor cpu_dst = as_cpu(dst);
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    cpu_dst.copy_(as_cpu(self), non_blocking);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// torch routes convolutions of backends it does not know to convolution_overrideable (and its backward): run the
// CPU convolution on the same memory.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                                    c10::IntArrayRef output_padding, int64_t groups) {
  Call call;
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::optional<at::Tensor> cpu_bias = bias.has_value() && bias->defined() ? std::optional<at::Tensor>(call.to_cpu(*bias))
                                                                            : std::nullopt;
    out = at::convolution(call.to_cpu(input), call.to_cpu(weight), cpu_bias, stride, padding, dilation, transposed,
                          output_padding, groups);
  }
  if (overflow_check.load()) {
    check_overflow(out);
  }
  return call.to_npu(out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> output_mask) {
  Call call;
  at::Tensor gi, gw, gb;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const int64_t channels = transposed ? weight.size(1) * groups : weight.size(0);
    std::vector<int64_t> bias_sizes{channels};
    std::tie(gi, gw, gb) = at::convolution_backward(call.to_cpu(grad_output), call.to_cpu(input),
                                                    call.to_cpu(weight), at::OptionalIntArrayRef(bias_sizes), stride,
                                                    padding, dilation, transposed, output_padding, groups,
                                                    output_mask);
  }
  if (overflow_check.load()) {
    check_overflow(gi);
    check_overflow(gw);
    check_overflow(gb);
  }
  return {call.to_npu(gi), call.to_npu(gw), call.to_npu(gb)};
}

// ------------------------------------------------------------------------------------------------ controls

bool get_overflow_flag() { return overflow_flag.load(); }
void clear_overflow_flag() { overflow_flag.store(false); }
void set_saturation_mode(bool on) { saturation_mode.store(on); }
bool get_saturation_mode() { return saturation_mode.load(); }
void set_overflow_check(bool on) { overflow_check.store(on); }
int64_t device_count() { return kDeviceCount; }
int64_t get_device() { return current_device; }
void set_device(int64_t index) {
  check_index(static_cast<c10::DeviceIndex>(index));
  current_device = static_cast<c10::DeviceIndex>(index);
}
std::vector<int64_t> memory_stats(int64_t index) {
  check_index(static_cast<c10::DeviceIndex>(index));
  const auto& s = stats[index];
  return {s.allocated.load(), s.peak.load(), s.allocations.load()};
}
void reset_peak_memory(int64_t index) {
  check_index(static_cast<c10::DeviceIndex>(index));
  stats[index].peak.store(stats[index].allocated.load());
}
int64_t get_fallback_calls() { return fallback_calls.load(); }

struct Registration {
  Registration() {
    c10::SetAllocator(kNpu, &allocator);
    at::RegisterPrivateUse1HooksInterface(new Hooks());  // lives as long as the process
  }
};
Registration registration;

}  // namespace
}  // namespace npu_emu

C10_REGISTER_GUARD_IMPL(PrivateUse1, npu_emu::GuardImpl);

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_emu::npu_fallback>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &npu_emu::empty_memory_format);
  m.impl("empty_strided", &npu_emu::empty_strided);
  m.impl("_copy_from", &npu_emu::copy_from);
  m.impl("_copy_from_and_resize", &npu_emu::copy_from_and_resize);
  // Without a kernel of its own, mse_loss would take torch's composite path through mse_loss.out, whose CPU kernel
  // resizes a 0-dim output (a deprecation warning on every call): run the functional CPU kernel instead.
  m.impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&npu_emu::npu_fallback>());
  m.impl("convolution_overrideable", &npu_emu::convolution_overrideable);
  m.impl("convolution_backward_overrideable", &npu_emu::convolution_backward_overrideable);
}

TORCH_LIBRARY_IMPL(c10d, PrivateUse1, m) {
  for (const char* name : {"allreduce_", "allreduce_coalesced_", "broadcast_", "allgather_", "_allgather_base_",
                           "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
                           "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_", "gather_",
                           "scatter_", "alltoall_", "alltoall_base_", "barrier", "send", "recv_",
                           "recv_any_source_", "monitored_barrier_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_emu::npu_collective>());
  }
}

TORCH_LIBRARY(npu_emu, m) {
  m.def("get_overflow_flag() -> bool", &npu_emu::get_overflow_flag);
  m.def("clear_overflow_flag() -> ()", &npu_emu::clear_overflow_flag);
  m.def("set_saturation_mode(bool on) -> ()", &npu_emu::set_saturation_mode);
  m.def("saturation_mode() -> bool", &npu_emu::get_saturation_mode);
  m.def("set_overflow_check(bool on) -> ()", &npu_emu::set_overflow_check);
  m.def("device_count() -> int", &npu_emu::device_count);
  m.def("current_device() -> int", &npu_emu::get_device);
  m.def("set_device(int index) -> ()", &npu_emu::set_device);
  m.def("memory_stats(int index) -> int[]", &npu_emu::memory_stats);
  m.def("reset_peak_memory(int index) -> ()", &npu_emu::reset_peak_memory);
  m.def("fallback_calls() -> int", &npu_emu::get_fallback_calls);
}
