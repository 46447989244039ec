// libtorch's CPU allocator for the whole process: HostMemory's cache, and device budgets charged
// for what kernels allocate on a device's stream.
#include <ATen/core/ivalue.h>  // before <torch/torch.h>, for clang: see torch_ops.h
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "compute/executable.h"
#include "compute/torch_ops.h"
#include "device/host_memory.h"

namespace pathways {

absl::Status& KernelMemoryFailure() {
  thread_local absl::Status failure;
  return failure;
}

namespace {
thread_local AllocationScope* current_scope = nullptr;
std::atomic<uint64_t> next_scope_id{1};
}  // namespace

AllocationScope::AllocationScope() : id_(next_scope_id.fetch_add(1)), outer_(current_scope) { current_scope = this; }
AllocationScope::~AllocationScope() { current_scope = outer_; }

// libtorch's CPU allocations (kernel outputs and temporaries) through HostMemory: a large one
// reuses the pages of an earlier one of its size instead of faulting in fresh ones. On a device's
// stream they are charged to the device's budget, as an accelerator's kernels take their
// temporaries from its memory: activations a gradient keeps, results before they are copied into
// their output buffers. One that does not fit waits, as output buffers do, for others to be
// released (by clients, or by transfers to other devices), then fails the kernel
// (ResourceExhausted). A header in front of the data says
// what to release; the data pointer is its own context, so raw_allocate works too.

class CachingHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    const std::shared_ptr<MemoryBudget>* budget = MemoryBudget::Current();
    if (budget != nullptr) {
      absl::Status charged = (*budget)->Charge(static_cast<int64_t>(bytes), (*budget)->kernel_wait());
      if (!charged.ok()) KernelMemoryFailure() = charged;
      TORCH_CHECK_WITH(OutOfMemoryError, charged.ok(), charged.message());
    }
    char* block = HostMemory::Allocate(bytes + kHeaderBytes);
    if (block == nullptr) {
      if (budget != nullptr) (*budget)->Release(static_cast<int64_t>(bytes));
      throw std::bad_alloc();
    }
    AllocationScope* scope = current_scope;
    if (scope != nullptr) scope->live_bytes_ += static_cast<int64_t>(bytes);
    new (block) Header{budget != nullptr ? *budget : nullptr, static_cast<int64_t>(bytes),
                       scope != nullptr ? scope->id_ : 0};
    char* data = block + kHeaderBytes;
    return {data, data, &Delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  // The AllocationScope that `data` was allocated in (0: none, or another allocator's) and the
  // bytes it counted.
  static std::pair<uint64_t, int64_t> ScopeOf(const c10::DataPtr& data) {
    if (data.get_deleter() != &Delete || data.get_context() == nullptr) return {0, 0};
    const auto* header = reinterpret_cast<const Header*>(static_cast<const char*>(data.get_context()) - kHeaderBytes);
    return {header->scope, header->bytes};
  }

 private:
  struct Header {
    std::shared_ptr<MemoryBudget> budget;
    int64_t bytes;
    uint64_t scope;  // the AllocationScope it was made in, or 0
  };
  static constexpr size_t kHeaderBytes = 64;  // keeps the data 64-byte aligned
  static_assert(sizeof(Header) <= kHeaderBytes);
  static void Delete(void* data) {
    if (data == nullptr) return;
    char* block = static_cast<char*>(data) - kHeaderBytes;
    Header* header = reinterpret_cast<Header*>(block);
    if (header->budget != nullptr) header->budget->Release(header->bytes);
    if (header->scope != 0 && current_scope != nullptr && current_scope->id_ == header->scope) {
      current_scope->live_bytes_ -= header->bytes;
    }
    header->~Header();
    HostMemory::Free(block);
  }
};

int64_t AllocationScope::BytesOf(const c10::Storage& storage) const {
  const auto [scope, bytes] = CachingHostAllocator::ScopeOf(storage.data_ptr());
  return scope == id_ ? bytes : 0;
}

void ConfigureComputeThreads(int intra_op_threads) {
  static std::once_flag allocator_installed;
  std::call_once(allocator_installed, [] {
    static CachingHostAllocator allocator;
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
  at::set_num_threads(intra_op_threads);
  // OpenBLAS keeps its own pool; bound it too when the library is loaded.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(intra_op_threads);
  }
}

}  // namespace pathways

