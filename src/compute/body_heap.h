// What a body allocates outside its tensors: TorchScript's lists, strings and dicts, the
// interpreter's frames. libtorch's tensors go through the device's allocator and budget
// (torch_allocator.cc); these go through C++'s operator new, which this file replaces for the
// whole process so that a body's own are counted, and, past an allowance, charged to the device
// running it. Without it, `[0] * 10**9` or a list doubling itself turn by turn would fill the
// host's memory before any timeout, and the kernel would take the worker down with every tenant
// on it. Torch-free.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "device/device.h"

namespace pathways {

// Counts the current thread's C++ allocations that are still held, for the scope's life, and in
// the executables that link tcmalloc (body_malloc.cc) what it takes with malloc too, as libtorch
// does for some of a tensor besides its data (device memory aside: its allocator charges it).
// Beyond `allowance` bytes they are charged to `budget` (the device's; null: counted only) in
// steps of 1 MiB, waiting as kernels' temporaries do; one that does not fit throws
// std::bad_alloc, and failure() says why. After a refusal a few MiB more are let through
// uncharged, so that the body's error can unwind, and nothing past them. Allocations freed on other
// threads meanwhile are not seen. Scopes nest: an inner one counts its own.
class ScopedBodyHeap {
 public:
  static constexpr int64_t kAllowance = int64_t{16} << 20;
  explicit ScopedBodyHeap(std::shared_ptr<MemoryBudget> budget, int64_t allowance = kAllowance);
  ~ScopedBodyHeap();  // releases what was charged
  ScopedBodyHeap(const ScopedBodyHeap&) = delete;
  ScopedBodyHeap& operator=(const ScopedBodyHeap&) = delete;

  int64_t live_bytes() const { return live_; }
  int64_t charged_bytes() const { return charged_; }
  const std::shared_ptr<MemoryBudget>& budget() const { return budget_; }
  // Takes `bytes` of what the body holds out of the count (at most all of it), for an owner that
  // keeps them past the body (a forward pass's residual graph). Of the charge the scope no longer
  // needs, up to the bytes taken passes to the owner (`*charge`, to release when it lets go: it
  // must charge the rest itself), so that no other work can take that room in between. Returns
  // the bytes taken.
  int64_t HandOver(int64_t bytes, int64_t* charge);
  // ResourceExhausted naming the device and the sizes, once an allocation was refused.
  const absl::Status& failure() const { return failure_; }

 private:
  friend bool BodyHeapGrew(int64_t bytes, bool refusable);
  friend void BodyHeapShrank(int64_t bytes);
  friend bool BodyHeapRefused();
  const std::shared_ptr<MemoryBudget> budget_;
  const int64_t allowance_;
  int64_t live_ = 0;
  int64_t charged_ = 0;
  bool charging_ = false;     // inside the budget's own calls, which may allocate
  int64_t unwind_limit_ = 0;  // once refused: what may be held while the error unwinds
  absl::Status failure_;
  ScopedBodyHeap* const outer_;
};

// Suspends the current thread's heap scope while the runtime's own code runs for a body: a
// collective's meeting and messages, the data ops' shared sources, checkpoint files. What that
// code allocates is neither counted nor refused: a refusal in the middle of it would leave state
// that other tenants' runs share half-updated (a collective's meeting without its members), and a
// charge could wait for memory while holding a lock their runs need. So that code must bound what
// a body can make it hold: its caches by count and by one spelling of their keys (a group's axes:
// collective/group.h CanonicalAxes), its buffers by what the device already holds (a collective's
// scratch is the size of its data). And nothing made in a pause may go to the body (an op's
// output is made outside it): a block made uncounted and freed in the scope would lower the count
// by what it never added.
class BodyHeapPause {
 public:
  BodyHeapPause();
  ~BodyHeapPause();
  BodyHeapPause(const BodyHeapPause&) = delete;
  BodyHeapPause& operator=(const BodyHeapPause&) = delete;

 private:
  ScopedBodyHeap* const paused_;
};

// Whether operator new counts a body's allocations: everywhere but under ThreadSanitizer, whose
// runtime defines operator new and delete itself (this file's would not link beside them).
bool BodyHeapCountsNew();
// Whether malloc, not only operator new, is counted: in a process whose malloc is body_malloc.cc's.
bool BodyHeapCountsMalloc();

// Whether the current thread's heap refused an allocation. A loop's turn stops there: what
// malloc may not refuse (below) is let through past the budget, and the run fails all the same.
bool BodyHeapRefused();

namespace body_heap_internal {
// The current thread's innermost scope, null outside bodies. constinit, so that a read from
// another file is a plain thread-local load, not a call: every malloc and free of the process
// asks (body_malloc.cc).
extern constinit thread_local ScopedBodyHeap* current;
}  // namespace body_heap_internal

// The current thread's innermost scope (null outside bodies), and for body_malloc.cc whether it has one; whether malloc
// is called by operator new, whose callers expect a refusal; and what an allocation of `bytes` (false: refused, the
// allocation must fail; one that may not be refused is counted all the same) or a free does.
inline ScopedBodyHeap* CurrentBodyHeap() { return body_heap_internal::current; }
inline bool BodyHeapActive() { return CurrentBodyHeap() != nullptr; }
bool BodyHeapInOperatorNew();
bool BodyHeapGrew(int64_t bytes, bool refusable);
void BodyHeapShrank(int64_t bytes);

}  // namespace pathways
