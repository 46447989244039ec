#include "device/host_memory.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <list>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace pathways {
namespace {

// Sizes are rounded so that nearly equal requests share cache entries: to 64 KiB, and to whole
// huge pages from 8 MiB on (those also ask for transparent huge pages: 512 times fewer faults).
constexpr size_t kHugeFrom = 8 << 20;
constexpr size_t kHugePage = 2 << 20;
constexpr size_t kGranule = 64 << 10;

size_t Rounded(size_t bytes) {
  const size_t unit = bytes >= kHugeFrom ? kHugePage : kGranule;
  return (bytes + unit - 1) / unit * unit;
}

thread_local uint64_t current_owner = 0;  // HostMemory::Owner; 0: none
// HostMemory::InsideAllocator. Volatile: the compiler knows malloc reads no program memory, and
// would drop the stores around its calls.
thread_local volatile int inside_allocator = 0;

struct AllocatorFrame {
  AllocatorFrame() { inside_allocator = inside_allocator + 1; }
  ~AllocatorFrame() { inside_allocator = inside_allocator - 1; }
};

// How many of the cached entries of a size an allocation looks through for one its owner freed.
constexpr int kOwnerSearch = 8;

struct Mapped {
  size_t size;
  uint64_t owner;  // that it was allocated for, or 0
};

struct Cache {
  absl::Mutex mu;
  size_t limit ABSL_GUARDED_BY(mu) = HostMemory::kDefaultCacheLimitBytes;
  size_t bytes ABSL_GUARDED_BY(mu) = 0;
  // Least recently freed last; per size, the entries in the order they were freed.
  std::list<std::pair<Mapped, char*>> lru ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<size_t, std::vector<std::list<std::pair<Mapped, char*>>::iterator>> by_size ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<char*, Mapped> live ABSL_GUARDED_BY(mu);  // mapped allocations in use, by address
  int64_t hits ABSL_GUARDED_BY(mu) = 0;
  int64_t allocations ABSL_GUARDED_BY(mu) = 0;

  // Drops the least recently freed entries until `bytes` fit under the limit; returns them.
  std::vector<std::pair<size_t, char*>> EvictFor(size_t incoming) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<std::pair<size_t, char*>> out;
    while (!lru.empty() && bytes + incoming > limit) {
      const size_t size = lru.back().first.size;
      char* data = lru.back().second;
      auto& same = by_size[size];
      same.erase(same.begin());  // the oldest of its size
      if (same.empty()) by_size.erase(size);
      lru.pop_back();
      bytes -= size;
      out.emplace_back(size, data);
    }
    return out;
  }
};

Cache& TheCache() {
  static auto* cache = new Cache();  // never destroyed: buffers may be freed during exit
  return *cache;
}

void Unmap(const std::vector<std::pair<size_t, char*>>& entries) {
  for (const auto& [size, data] : entries) munmap(data, size);
}

}  // namespace

char* HostMemory::Allocate(size_t bytes) {
  const AllocatorFrame inside;
  const uint64_t owner = current_owner;
  if (bytes < kCachedMinBytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    char* data = static_cast<char*>(std::aligned_alloc(64, rounded == 0 ? 64 : rounded));
    if (data != nullptr && owner != 0) std::memset(data, 0, rounded);  // malloc's: anyone's
    return data;
  }
  const size_t size = Rounded(bytes);
  Cache& cache = TheCache();
  char* hit = nullptr;
  bool clear = false;  // it holds what another owner, or none known, left there
  {
    absl::MutexLock lock(&cache.mu);
    ++cache.allocations;
    if (auto it = cache.by_size.find(size); it != cache.by_size.end()) {
      // The most recently freed (its pages are likeliest warm) of those its owner freed, if one
      // is among the last few; else the most recently freed.
      auto& same = it->second;
      auto pick = same.end() - 1;
      for (auto e = same.end(); e != same.begin() && same.end() - e < kOwnerSearch;) {
        --e;
        if ((*e)->first.owner == owner) {
          pick = e;
          break;
        }
      }
      auto entry = *pick;
      same.erase(pick);
      if (same.empty()) cache.by_size.erase(it);
      hit = entry->second;
      clear = owner != 0 && entry->first.owner != owner;
      cache.lru.erase(entry);
      cache.bytes -= size;
      ++cache.hits;
      cache.live.emplace(hit, Mapped{size, owner});
    }
  }
  if (hit != nullptr) {
    // All of it: an owner that reuses the block for more of the same rounded size sees its tail.
    if (clear) std::memset(hit, 0, size);
    return hit;
  }
  void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) {
    // The cache may hold what the system lacks.
    std::vector<std::pair<size_t, char*>> freed;
    {
      absl::MutexLock lock(&cache.mu);
      freed = cache.EvictFor(cache.limit);  // everything
    }
    Unmap(freed);
    data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) return nullptr;
  }
  if (size >= kHugeFrom) madvise(data, size, MADV_HUGEPAGE);
  absl::MutexLock lock(&cache.mu);
  cache.live.emplace(static_cast<char*>(data), Mapped{size, owner});
  return static_cast<char*>(data);
}

void HostMemory::Free(void* ptr) {
  if (ptr == nullptr) return;
  const AllocatorFrame inside;
  char* data = static_cast<char*>(ptr);
  Cache& cache = TheCache();
  std::vector<std::pair<size_t, char*>> evicted;
  bool mapped = false;
  {
    absl::MutexLock lock(&cache.mu);
    if (auto it = cache.live.find(data); it != cache.live.end()) {
      mapped = true;
      const Mapped m = it->second;
      cache.live.erase(it);
      if (m.size > cache.limit) {
        evicted.emplace_back(m.size, data);
      } else {
        evicted = cache.EvictFor(m.size);
        cache.lru.emplace_front(m, data);
        cache.by_size[m.size].push_back(cache.lru.begin());
        cache.bytes += m.size;
      }
    }
  }
  if (!mapped) std::free(data);  // a small one, from malloc
  Unmap(evicted);
}

bool HostMemory::InsideAllocator() { return inside_allocator > 0; }

HostMemory::Owner::Owner(uint64_t owner) : outer_(current_owner) { current_owner = owner; }
HostMemory::Owner::~Owner() { current_owner = outer_; }

void HostMemory::SetCacheLimit(size_t bytes) {
  Cache& cache = TheCache();
  std::vector<std::pair<size_t, char*>> evicted;
  {
    absl::MutexLock lock(&cache.mu);
    cache.limit = bytes;
    evicted = cache.EvictFor(0);
  }
  Unmap(evicted);
}

size_t HostMemory::cached_bytes() {
  Cache& cache = TheCache();
  absl::MutexLock lock(&cache.mu);
  return cache.bytes;
}

int64_t HostMemory::cache_hits() {
  Cache& cache = TheCache();
  absl::MutexLock lock(&cache.mu);
  return cache.hits;
}

int64_t HostMemory::cached_allocations() {
  Cache& cache = TheCache();
  absl::MutexLock lock(&cache.mu);
  return cache.allocations;
}

}  // namespace pathways
