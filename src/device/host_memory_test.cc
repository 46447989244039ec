#include "device/host_memory.h"

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// The cache is process-wide: each test starts from an empty one with the default limit.
class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostMemory::SetCacheLimit(0);
    HostMemory::SetCacheLimit(HostMemory::kDefaultCacheLimitBytes);
  }
};

TEST_F(HostMemoryTest, SmallAndLargeAllocationsAreAlignedAndUsable) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{1000}, HostMemory::kCachedMinBytes, size_t{9} << 20}) {
    char* p = HostMemory::Allocate(bytes);
    ASSERT_NE(p, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes;
    std::memset(p, 7, bytes);
    HostMemory::Free(p);
  }
  HostMemory::Free(nullptr);
}

TEST_F(HostMemoryTest, AFreedLargeAllocationIsHandedOutAgainForTheSameSize) {
  const int64_t hits = HostMemory::cache_hits();
  char* a = HostMemory::Allocate(3 << 20);
  a[0] = 42;
  HostMemory::Free(a);
  EXPECT_EQ(HostMemory::cached_bytes(), size_t{3} << 20);
  // A request that rounds to the same size gets the same pages.
  char* b = HostMemory::Allocate((3 << 20) - 100);
  EXPECT_EQ(b, a);
  EXPECT_EQ(HostMemory::cache_hits(), hits + 1);
  EXPECT_EQ(HostMemory::cached_bytes(), 0u);
  // Another size does not.
  char* c = HostMemory::Allocate(5 << 20);
  EXPECT_NE(c, a);
  HostMemory::Free(b);
  HostMemory::Free(c);
}

TEST_F(HostMemoryTest, TheCacheStaysWithinItsLimitDroppingTheLeastRecentlyFreed) {
  HostMemory::SetCacheLimit(size_t{10} << 20);
  std::vector<char*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(HostMemory::Allocate(4 << 20));
  for (char* b : blocks) HostMemory::Free(b);
  EXPECT_LE(HostMemory::cached_bytes(), size_t{10} << 20);
  EXPECT_EQ(HostMemory::cached_bytes(), size_t{8} << 20);  // the last two freed
  char* again = HostMemory::Allocate(4 << 20);
  EXPECT_EQ(again, blocks[3]);  // the most recently freed first
  HostMemory::Free(again);
  // Larger than the whole limit: never cached.
  HostMemory::Free(HostMemory::Allocate(16 << 20));
  EXPECT_LE(HostMemory::cached_bytes(), size_t{10} << 20);
  HostMemory::SetCacheLimit(0);
  EXPECT_EQ(HostMemory::cached_bytes(), 0u);
}

TEST_F(HostMemoryTest, ThreadsAllocatingAndFreeingAtOnceKeepTheCacheConsistent) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = static_cast<size_t>(1 + (i + t) % 3) << 20;
        char* p = HostMemory::Allocate(bytes);
        ASSERT_NE(p, nullptr);
        p[bytes - 1] = static_cast<char>(i);
        HostMemory::Free(p);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(HostMemory::cached_bytes(), HostMemory::kDefaultCacheLimitBytes);
}

}  // namespace
}  // namespace pathways
