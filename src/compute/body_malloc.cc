// malloc and its kin, for the executables that link tcmalloc: tcmalloc's, with what a body's thread
// holds counted and charged by its ScopedBodyHeap (compute/body_heap.h), as operator new's is
// elsewhere. libtorch takes some of a tensor besides its data with malloc, not operator new: c10
// keeps the sizes and strides of a tensor of more than five dimensions there, and 600 views of one
// of 200,000 dimensions held 2 GB of the host against 35 MB charged. Device memory is left to its
// allocator, which charges it.
//
// Past the device's budget, operator new's calls and blocks of 64 KiB or more get null, as from the
// system (c10 raises, C++ throws std::bad_alloc, and the run fails ResourceExhausted). Smaller ones
// are let through and the heap marked refused: C libraries may take a null for a fatal error (libgomp
// exits, the loader aborts), so the body stops at its next loop turn instead, and its run fails.
//
// Defined in the executable, these come before tcmalloc's and libc's for every library in the
// process. Linked only into executables, and only where tcmalloc is (src/compute/CMakeLists.txt):
// not into the Python extension, whose interpreter allocated with glibc before loading it, nor
// under the sanitizers, which bring their own allocator. tcmalloc's malloc hooks would see the same
// without replacing malloc, but cannot refuse, and with one installed every allocation of the process
// takes tcmalloc's slow path (dispatch throughput 0.73-0.83 of without, measured).
#include <gperftools/tcmalloc.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "compute/body_heap.h"
#include "device/host_memory.h"

namespace pathways {
namespace {

constexpr size_t kRefusableBytes = size_t{64} << 10;

bool Counting() { return BodyHeapActive() && !HostMemory::InsideAllocator(); }

bool Refusable(size_t bytes) { return bytes >= kRefusableBytes || BodyHeapInOperatorNew(); }

// `p`, of `requested` bytes, as the caller gets it: null when the body's heap refuses it.
__attribute__((noinline)) void* Counted(void* p, size_t requested) {
  if (p == nullptr || !Counting()) return p;
  if (BodyHeapGrew(static_cast<int64_t>(tc_malloc_size(p)), Refusable(requested))) return p;
  tc_free(p);
  errno = ENOMEM;
  return nullptr;
}

__attribute__((noinline)) void Forget(void* p) {
  if (p != nullptr && Counting()) BodyHeapShrank(static_cast<int64_t>(tc_malloc_size(p)));
}

}  // namespace
}  // namespace pathways

extern "C" {

// Its presence tells operator new (body_heap.cc) that malloc counts.
void PathwaysBodyMalloc() {}

// Outside bodies, nearly every call of the process: straight to tcmalloc, after one thread-local load.
void* malloc(size_t bytes) {
  if (!pathways::BodyHeapActive()) [[likely]]
    return tc_malloc(bytes);
  return pathways::Counted(tc_malloc(bytes), bytes);
}
void free(void* p) {
  if (pathways::BodyHeapActive()) [[unlikely]]
    pathways::Forget(p);
  tc_free(p);
}
void* calloc(size_t count, size_t bytes) {
  if (!pathways::Counting()) return tc_calloc(count, bytes);
  // Charged before the block is zeroed: a refused one is never written.
  size_t total = 0;
  if (__builtin_mul_overflow(count, bytes, &total)) {
    errno = ENOMEM;
    return nullptr;
  }
  void* p = malloc(total);
  if (p != nullptr) std::memset(p, 0, total);
  return p;
}
void* realloc(void* p, size_t bytes) {
  if (p == nullptr) return malloc(bytes);
  if (bytes == 0) {
    free(p);
    return nullptr;
  }
  if (!pathways::Counting()) return tc_realloc(p, bytes);
  const size_t held = tc_malloc_size(p);
  if (bytes <= held && bytes >= held / 2) return p;
  // Moved to a new block, counted as such, so that a refusal leaves `p` as it was; grown by a
  // quarter at least, so that growing step by step stays linear.
  void* moved = malloc(bytes > held ? std::max(bytes, held + held / 4) : bytes);
  if (moved == nullptr) return nullptr;
  std::memcpy(moved, p, std::min(bytes, held));
  free(p);
  return moved;
}
void* memalign(size_t alignment, size_t bytes) { return pathways::Counted(tc_memalign(alignment, bytes), bytes); }
void* aligned_alloc(size_t alignment, size_t bytes) { return pathways::Counted(tc_memalign(alignment, bytes), bytes); }
int posix_memalign(void** out, size_t alignment, size_t bytes) {
  void* p = nullptr;
  const int failed = tc_posix_memalign(&p, alignment, bytes);
  if (failed != 0) return failed;
  const int saved = errno;
  p = pathways::Counted(p, bytes);
  errno = saved;
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(size_t bytes) { return pathways::Counted(tc_valloc(bytes), bytes); }
void* pvalloc(size_t bytes) { return pathways::Counted(tc_pvalloc(bytes), bytes); }
size_t malloc_usable_size(void* p) { return tc_malloc_size(p); }

}  // extern "C"
