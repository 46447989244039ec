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

bool AllZero(const char* p, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

// Memory goes from one tenant to another with nothing of the first in it: a cached block another
// owner freed, and any small block (malloc's, whoever freed it), are zeroed for an owner; a block
// its own owner freed comes back as it was, and one of another size, and one among the last few
// of its size that the owner freed, is preferred to zeroing.
TEST_F(HostMemoryTest, AnOwnerNeverSeesWhatAnotherLeftInTheMemoryItGets) {
  constexpr size_t kLarge = 3 << 20, kSmall = 4096;
  char* a;
  char* a2;
  {
    HostMemory::Owner tenant_a(1);
    a = HostMemory::Allocate(kLarge);
    std::memset(a, 0x5a, kLarge);
    HostMemory::Free(a);
    char* again = HostMemory::Allocate(kLarge);
    EXPECT_EQ(again, a);
    EXPECT_EQ(again[kLarge - 1], 0x5a) << "its own: handed back as it was";
    HostMemory::Free(again);
  }
  {
    HostMemory::Owner tenant_b(2);
    char* b = HostMemory::Allocate(kLarge);
    EXPECT_EQ(b, a) << "the same pages, reused";
    EXPECT_TRUE(AllZero(b, kLarge));
    std::memset(b, 0x6b, kLarge);
    // A's freed block is chosen for A over B's more recent one.
    {
      HostMemory::Owner tenant_a(1);
      a2 = HostMemory::Allocate(kLarge);
      std::memset(a2, 0x5a, kLarge);
    }
    HostMemory::Free(a2);
    HostMemory::Free(b);
    {
      HostMemory::Owner tenant_a(1);
      char* mine = HostMemory::Allocate(kLarge);
      EXPECT_EQ(mine, a2);
      EXPECT_EQ(mine[0], 0x5a);
      HostMemory::Free(mine);
    }
    for (int i = 0; i < 100; ++i) {  // small blocks are malloc's: always zeroed for an owner
      char* s = HostMemory::Allocate(kSmall);
      ASSERT_TRUE(AllZero(s, kSmall));
      std::memset(s, 0x6b, kSmall);
      HostMemory::Free(s);
    }
  }
  // All of a reused block is zeroed, not only what was asked: an owner that takes it again for
  // more of the same rounded size (no zeroing: its own) must not find the other's tail there.
  {
    constexpr size_t kRounded = 18 << 16;
    char* theirs;
    {
      HostMemory::Owner tenant_b(2);
      theirs = HostMemory::Allocate(kRounded);
      std::memset(theirs, 0x6b, kRounded);
      HostMemory::Free(theirs);
    }
    HostMemory::Owner tenant_a(1);
    char* small = HostMemory::Allocate(kRounded - (1 << 16) + 1);
    ASSERT_EQ(small, theirs);
    HostMemory::Free(small);
    char* whole = HostMemory::Allocate(kRounded);
    ASSERT_EQ(whole, theirs);
    EXPECT_TRUE(AllZero(whole, kRounded));
    HostMemory::Free(whole);
  }
  // Without an owner (buffers written whole before they are read) nothing is zeroed.
  char* plain = HostMemory::Allocate(kLarge);
  EXPECT_EQ(plain, a2) << "the most recently freed";
  EXPECT_EQ(plain[0], 0x5a);
  HostMemory::Free(plain);
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
