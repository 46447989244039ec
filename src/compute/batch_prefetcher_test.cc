#include "compute/batch_prefetcher.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// A source whose step k is k, k+1, ...: what a draw gives is easy to check; `draws` counts them.
BatchPrefetcher::Draw Counting(std::atomic<int>& draws) {
  return [&draws](uint64_t step, int64_t* out) {
    ++draws;
    for (int i = 0; i < 4; ++i) out[i] = static_cast<int64_t>(step) + i;
    return absl::OkStatus();
  };
}

TEST(BatchPrefetcherTest, TheNextStepIsDrawnAheadAndEachStepOnce) {
  BatchPrefetcher prefetcher;
  std::atomic<int> draws{0};
  int64_t out[4];
  for (uint64_t step = 0; step < 5; ++step) {
    ASSERT_TRUE(prefetcher.Get("a", step, 4, Counting(draws), out).ok());
    for (int i = 0; i < 4; ++i) ASSERT_EQ(out[i], static_cast<int64_t>(step) + i) << step;
  }
  EXPECT_EQ(prefetcher.stats().misses, 1);  // only step 0 was drawn by the caller
  EXPECT_EQ(prefetcher.stats().hits, 4);
  // A step out of order (a resumed run, a retry) is drawn where asked, and is still right.
  ASSERT_TRUE(prefetcher.Get("a", 42, 4, Counting(draws), out).ok());
  EXPECT_EQ(out[0], 42);
  EXPECT_EQ(prefetcher.stats().misses, 2);
  // Another key (another shard, source or size) has batches of its own.
  ASSERT_TRUE(prefetcher.Get("b", 43, 4, Counting(draws), out).ok());
  EXPECT_EQ(out[0], 43);
  EXPECT_EQ(prefetcher.stats().misses, 3);
}

TEST(BatchPrefetcherTest, ShardsDrawingAtOnceEachGetTheirOwnBatches) {
  BatchPrefetcher prefetcher(/*max_batches=*/4);
  std::atomic<int> draws{0};
  std::vector<std::thread> shards;
  std::atomic<int> wrong{0};
  for (int s = 0; s < 8; ++s) {
    shards.emplace_back([&, s] {
      int64_t out[4];
      for (uint64_t step = 0; step < 50; ++step) {
        ASSERT_TRUE(prefetcher.Get("shard" + std::to_string(s), step, 4, Counting(draws), out).ok());
        if (out[0] != static_cast<int64_t>(step)) ++wrong;
      }
    });
  }
  for (std::thread& t : shards) t.join();
  EXPECT_EQ(wrong.load(), 0);
  // More keys than the prefetcher keeps: each key still gets right batches; memory stays bounded.
  EXPECT_EQ(prefetcher.stats().hits + prefetcher.stats().misses, 8 * 50);
}

// A tenant asking for many large, different batches cannot make the host hold more than the
// bound: batches over a quarter of it are not drawn ahead, and others make room in turn; every
// batch still comes back right.
TEST(BatchPrefetcherTest, WhatIsHeldAheadStaysWithinItsBytes) {
  constexpr size_t kBound = 64 << 10;  // bytes
  BatchPrefetcher prefetcher(/*max_batches=*/1000, kBound);
  std::vector<int64_t> out(kBound);
  auto fill = [](uint64_t step, int64_t* o, size_t n) {
    for (size_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(step + i);
    return absl::OkStatus();
  };
  for (int key = 0; key < 200; ++key) {
    const size_t n = key % 2 == 0 ? kBound / 8 / 8 : kBound / 8;  // an eighth of the bound, or all of it
    ASSERT_TRUE(prefetcher.Get("k" + std::to_string(key), 7, n,
                   [n, fill](uint64_t step, int64_t* o) { return fill(step, o, n); }, out.data()).ok());
    ASSERT_EQ(out[n - 1], static_cast<int64_t>(7 + n - 1));
    ASSERT_LE(prefetcher.stats().bytes_ahead, static_cast<int64_t>(kBound));
  }
  // And the next steps of the last small keys are still right whether or not they were kept.
  for (int key = 190; key < 200; key += 2) {
    const size_t n = kBound / 8 / 8;
    ASSERT_TRUE(prefetcher.Get("k" + std::to_string(key), 8, n,
                   [n, fill](uint64_t step, int64_t* o) { return fill(step, o, n); }, out.data()).ok());
    ASSERT_EQ(out[0], 8);
    ASSERT_EQ(out[n - 1], static_cast<int64_t>(8 + n - 1));
  }
}

// A draw that fails ahead (the data changed meanwhile) is drawn again by its caller; a draw that
// fails where asked fails the Get.
TEST(BatchPrefetcherTest, ADrawThatFailsAheadIsTheCallersToDrawAndReport) {
  BatchPrefetcher prefetcher;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> broken{false};
  auto draw = [&](uint64_t step, int64_t* out) {
    if (broken || std::this_thread::get_id() != caller) return absl::DataLossError("the file changed");
    out[0] = static_cast<int64_t>(step);
    return absl::OkStatus();
  };
  int64_t out[1] = {-1};
  ASSERT_TRUE(prefetcher.Get("a", 0, 1, draw, out).ok());
  ASSERT_TRUE(prefetcher.Get("a", 1, 1, draw, out).ok());  // its draw ahead failed: drawn here
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(prefetcher.stats().hits, 0);
  EXPECT_EQ(prefetcher.stats().misses, 2);
  broken = true;
  EXPECT_EQ(prefetcher.Get("a", 2, 1, draw, out).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace pathways
