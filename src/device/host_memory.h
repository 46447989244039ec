// Host memory for device buffers and kernel temporaries, with a bounded cache of freed large
// allocations.
//
// A buffer of several MiB from malloc is a fresh mapping each time: the kernel clears and faults
// in every page on first touch, and unmaps it again on free (a 64 MiB block spent more time in
// page faults than in moving its bytes). Programs reuse the same shapes step after step, so freed
// large allocations are kept, by size, and handed out again with their pages already in place:
// the host-memory counterpart of an accelerator runtime's caching allocator. The cache is bounded
// (least recently freed go back to the system first), so a process holds at most its live
// buffers plus the limit. Small allocations come from malloc. Thread-safe.
//
// Memory is handed from one tenant to another with nothing of the first left in it. A thread
// doing a tenant's work names it (Owner); what it allocates that may hold bytes another owner, or
// nobody known, left there (any small allocation; a cached one freed under another owner) is
// zeroed first. Fresh pages are zero already, and a cached allocation its own owner freed is
// handed back as it is, so a tenant reusing its own shapes step after step pays nothing.
// Allocations made under no owner (buffers that are written whole before anything reads them:
// puts, transfers) are not zeroed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pathways {

class HostMemory {
 public:
  // Allocations of at least this many bytes are mapped pages, cached when freed.
  static constexpr size_t kCachedMinBytes = 1 << 20;
  static constexpr size_t kDefaultCacheLimitBytes = size_t{256} << 20;

  // 64-byte aligned, at least `bytes` long (at least one byte when 0); null when the system has
  // no memory left.
  static char* Allocate(size_t bytes);
  // Anything Allocate returned (null is ignored).
  static void Free(void* data);

  // While one lives, this thread's allocations are made for `owner` (nonzero; a tenant's id), as
  // above. Scopes nest; the innermost applies.
  class Owner {
   public:
    explicit Owner(uint64_t owner);
    ~Owner();
    Owner(const Owner&) = delete;
    Owner& operator=(const Owner&) = delete;

   private:
    const uint64_t outer_;
  };

  // Whether this thread is inside Allocate or Free: what malloc hands out there is a device's
  // memory, charged to its budget by whoever asked, not a body's heap (compute/body_heap.h).
  static bool InsideAllocator();

  // How much freed memory the cache may hold; shrinking it releases the excess at once.
  static void SetCacheLimit(size_t bytes);
  static size_t cached_bytes();
  // Allocations served from the cache, and all cached-size allocations (tests, benchmarks).
  static int64_t cache_hits();
  static int64_t cached_allocations();
};

}  // namespace pathways
