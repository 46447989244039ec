#include "compute/body_heap.h"

#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"
#include "device/host_memory.h"

namespace pathways {
namespace {

constexpr int64_t kChargeStep = int64_t{1} << 20;
constexpr int64_t kUnwindSlack = int64_t{4} << 20;
}  // namespace

constinit thread_local ScopedBodyHeap* body_heap_internal::current = nullptr;

ScopedBodyHeap::ScopedBodyHeap(std::shared_ptr<MemoryBudget> budget, int64_t allowance)
    : budget_(std::move(budget)), allowance_(allowance), outer_(body_heap_internal::current) {
  body_heap_internal::current = this;
}

ScopedBodyHeap::~ScopedBodyHeap() {
  body_heap_internal::current = outer_;
  if (charged_ > 0) budget_->Release(charged_);
}

int64_t ScopedBodyHeap::HandOver(int64_t bytes, int64_t* charge) {
  const int64_t taken = std::clamp<int64_t>(bytes, 0, live_);
  live_ -= taken;
  const int64_t over = live_ - allowance_;
  const int64_t needed = over <= 0 ? 0 : (over + kChargeStep - 1) / kChargeStep * kChargeStep;
  const int64_t spare = std::max<int64_t>(charged_ - needed, 0);
  charged_ -= spare;
  *charge = std::min(spare, taken);
  if (spare > *charge) budget_->Release(spare - *charge);
  return taken;
}

BodyHeapPause::BodyHeapPause() : paused_(body_heap_internal::current) { body_heap_internal::current = nullptr; }

BodyHeapPause::~BodyHeapPause() { body_heap_internal::current = paused_; }

// False when the allocation of `bytes` may not be made: it would not fit the budget. One that
// may not be refused is counted, and charged as far as it fits, all the same.
bool BodyHeapGrew(int64_t bytes, bool refusable) {
  ScopedBodyHeap* heap = body_heap_internal::current;
  if (heap == nullptr || heap->charging_) return true;
  heap->live_ += bytes;
  if (!heap->failure_.ok()) {
    // Refused once: what the error's unwinding takes is let through, up to a slack (libtorch
    // catches some errors, constant folding's for one, so a refusal need not end the body).
    if (heap->live_ <= heap->unwind_limit_ || !refusable) return true;
    heap->live_ -= bytes;
    return false;
  }
  const int64_t over = heap->live_ - heap->allowance_ - heap->charged_;
  if (over <= 0 || heap->budget_ == nullptr) return true;
  heap->charging_ = true;
  const int64_t step = (over + kChargeStep - 1) / kChargeStep * kChargeStep;
  absl::Status charged = heap->budget_->Charge(step, heap->budget_->kernel_wait());
  if (charged.ok()) {
    heap->charged_ += step;
  } else {
    if (refusable) heap->live_ -= bytes;
    heap->failure_ = absl::ResourceExhaustedError(absl::StrCat(
        "its lists, strings and other values besides tensors hold ", heap->live_, " bytes and asked for ", bytes,
        " more, past the ", heap->allowance_, " bytes a body may hold uncharged: ", charged.message()));
    heap->unwind_limit_ = heap->live_ + kUnwindSlack;
  }
  heap->charging_ = false;
  return charged.ok() || !refusable;
}

void BodyHeapShrank(int64_t bytes) {
  ScopedBodyHeap* heap = body_heap_internal::current;
  // Not below nothing: a block from before the scope, freed in it, is no allowance for the body.
  if (heap != nullptr && !heap->charging_) heap->live_ = std::max<int64_t>(heap->live_ - bytes, 0);
}

bool BodyHeapRefused() { return body_heap_internal::current != nullptr && !body_heap_internal::current->failure_.ok(); }

namespace {
// Inside operator new's own malloc, whose failure C++ code expects (std::bad_alloc). Volatile: the
// compiler knows malloc reads no program memory, and would drop the stores around its call.
thread_local volatile bool in_operator_new = false;

class InOperatorNew {
 public:
  InOperatorNew() : outer_(in_operator_new) { in_operator_new = true; }
  ~InOperatorNew() { in_operator_new = outer_; }

 private:
  const bool outer_;
};
}  // namespace

bool BodyHeapInOperatorNew() { return in_operator_new; }

// Defined by body_malloc.cc, which the executables that link tcmalloc take: their malloc counts,
// and operator new leaves the counting to it.
extern "C" void PathwaysBodyMalloc() __attribute__((weak));

bool BodyHeapCountsMalloc() { return &PathwaysBodyMalloc != nullptr; }

namespace {

// Whether operator new counts what it allocates itself: in a body, where malloc does not count, and
// outside the device's own allocator (its memory is charged by it), as body_malloc.cc does.
bool NewCounts() {
  return body_heap_internal::current != nullptr && &PathwaysBodyMalloc == nullptr && !HostMemory::InsideAllocator();
}

// Inside a body, or aligned: counted unless malloc counts (NewCounts).
__attribute__((noinline)) void* AllocateCounted(std::size_t bytes, std::size_t alignment) {
  void* p = nullptr;
  {
    const InOperatorNew inside;
    if (alignment <= alignof(std::max_align_t)) {
      p = std::malloc(bytes);
    } else if (posix_memalign(&p, alignment, bytes) != 0) {
      p = nullptr;
    }
  }
  if (p == nullptr) return nullptr;
  if (NewCounts() && !BodyHeapGrew(static_cast<int64_t>(malloc_usable_size(p)), /*refusable=*/true)) {
    std::free(p);
    return nullptr;
  }
  return p;
}

inline void* Allocate(std::size_t bytes, std::size_t alignment) {
  if (bytes == 0) bytes = 1;
  // Outside bodies (nearly every allocation of the process): malloc, and nothing else.
  if (alignment <= alignof(std::max_align_t) && !BodyHeapActive()) [[likely]]
    return std::malloc(bytes);
  return AllocateCounted(bytes, alignment);
}

void* AllocateOrThrow(std::size_t bytes, std::size_t alignment) {
  void* p = Allocate(bytes, alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

__attribute__((noinline)) void Forget(void* p) {
  if (NewCounts() && p != nullptr) BodyHeapShrank(static_cast<int64_t>(malloc_usable_size(p)));
}

inline void Free(void* p) noexcept {
  if (BodyHeapActive()) [[unlikely]]
    Forget(p);
  std::free(p);
}

}  // namespace
}  // namespace pathways

// ThreadSanitizer's runtime defines the allocation functions itself, to see every block.
#if defined(__SANITIZE_THREAD__)
#define PATHWAYS_REPLACES_NEW 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PATHWAYS_REPLACES_NEW 0
#endif
#endif
#ifndef PATHWAYS_REPLACES_NEW
#define PATHWAYS_REPLACES_NEW 1
#endif

bool pathways::BodyHeapCountsNew() { return PATHWAYS_REPLACES_NEW; }

#if PATHWAYS_REPLACES_NEW
// The replaceable global allocation functions ([new.delete]): malloc and free, as libstdc++'s, with
// the current body's count kept. Linked into every program that links the compute layer
// (TorchExecutable::Run uses ScopedBodyHeap), and so used by libtorch's code in it too.
void* operator new(std::size_t n) { return pathways::AllocateOrThrow(n, 0); }
void* operator new[](std::size_t n) { return pathways::AllocateOrThrow(n, 0); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return pathways::Allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return pathways::Allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return pathways::AllocateOrThrow(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return pathways::AllocateOrThrow(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return pathways::Allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return pathways::Allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { pathways::Free(p); }
void operator delete[](void* p) noexcept { pathways::Free(p); }
void operator delete(void* p, std::size_t) noexcept { pathways::Free(p); }
void operator delete[](void* p, std::size_t) noexcept { pathways::Free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { pathways::Free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { pathways::Free(p); }
void operator delete(void* p, std::align_val_t) noexcept { pathways::Free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { pathways::Free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { pathways::Free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { pathways::Free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { pathways::Free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { pathways::Free(p); }
#endif  // PATHWAYS_REPLACES_NEW
