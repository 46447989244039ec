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

  // How much freed memory the cache may hold; shrinking it releases the excess at once.
  static void SetCacheLimit(size_t bytes);
  static size_t cached_bytes();
  // Allocations served from the cache, and all cached-size allocations (tests, benchmarks).
  static int64_t cache_hits();
  static int64_t cached_allocations();
};

}  // namespace pathways
