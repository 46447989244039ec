#include "compute/body_heap.h"

#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(BodyHeapTest, WhatABodyHoldsPastItsAllowanceIsChargedToTheDeviceAndRefusedPastItsMemory) {
  if (!BodyHeapCountsNew()) GTEST_SKIP() << "a body's operator new is not counted in this build (ThreadSanitizer)";
  auto budget = std::make_shared<MemoryBudget>("cpu:0", 8 * kMiB);
  std::vector<std::string> held;
  {
    ScopedBodyHeap heap(budget, 2 * kMiB);
    held.emplace_back(kMiB, 'a');  // within the allowance: counted, not charged
    EXPECT_GE(heap.live_bytes(), kMiB);
    EXPECT_EQ(budget->used(), 0);
    for (int i = 0; i < 4; ++i) held.emplace_back(kMiB, 'b');  // 5 MiB held: 3 charged
    EXPECT_GE(heap.live_bytes(), 5 * kMiB);
    EXPECT_GE(budget->used(), 3 * kMiB);
    EXPECT_EQ(budget->used(), heap.charged_bytes());
    held.clear();  // freed on this thread: no longer held, still charged until the scope ends
    EXPECT_LT(heap.live_bytes(), kMiB);

    // 16 MiB do not fit the device's 8: refused, and the heap says why.
    EXPECT_THROW(held.emplace_back(16 * kMiB, 'c'), std::bad_alloc);
    EXPECT_EQ(heap.failure().code(), absl::StatusCode::kResourceExhausted) << heap.failure();
    EXPECT_NE(heap.failure().message().find("cpu:0"), std::string::npos) << heap.failure();
    // After a refusal a little more is let through, so the body's error can unwind; not more.
    held.emplace_back(kMiB, 'd');
    EXPECT_THROW(held.emplace_back(16 * kMiB, 'd'), std::bad_alloc);
    held.clear();
  }
  EXPECT_EQ(budget->used(), 0) << "the scope released what it charged";

  // Outside a scope, and in a scope without a budget, nothing is charged or refused.
  held.emplace_back(16 * kMiB, 'e');
  {
    ScopedBodyHeap counted_only(nullptr, 0);
    held.emplace_back(16 * kMiB, 'f');
    EXPECT_GE(counted_only.live_bytes(), 16 * kMiB);
    EXPECT_TRUE(counted_only.failure().ok());
  }
  held.clear();
}

TEST(BodyHeapTest, ScopesNestAndTheInnerCountsItsOwn) {
  if (!BodyHeapCountsNew()) GTEST_SKIP() << "a body's operator new is not counted in this build (ThreadSanitizer)";
  auto budget = std::make_shared<MemoryBudget>("cpu:0", 64 * kMiB);
  std::vector<std::string> held;
  ScopedBodyHeap outer(budget, 0);
  held.emplace_back(kMiB, 'a');
  const int64_t outer_live = outer.live_bytes();
  {
    ScopedBodyHeap inner(budget, 0);
    held.emplace_back(2 * kMiB, 'b');
    EXPECT_GE(inner.live_bytes(), 2 * kMiB);
    EXPECT_EQ(outer.live_bytes(), outer_live);
  }
  EXPECT_EQ(budget->used(), outer.charged_bytes());
}

// What an owner keeps past the body (a residual graph) leaves the count, and the scope's charge
// shrinks to what it still needs; the owner charges it itself.
TEST(BodyHeapTest, WhatIsHandedOverLeavesTheCountAndItsCharge) {
  if (!BodyHeapCountsNew()) GTEST_SKIP() << "a body's operator new is not counted in this build (ThreadSanitizer)";
  auto budget = std::make_shared<MemoryBudget>("cpu:0", 64 * kMiB);
  std::vector<std::string> held;
  ScopedBodyHeap heap(budget, 2 * kMiB);
  for (int i = 0; i < 6; ++i) held.emplace_back(kMiB, 'a');
  ASSERT_GE(budget->used(), 4 * kMiB);
  const int64_t live = heap.live_bytes(), used = budget->used();
  int64_t moved = 0;
  EXPECT_EQ(heap.HandOver(3 * kMiB, &moved), 3 * kMiB);
  EXPECT_EQ(heap.live_bytes(), live - 3 * kMiB);
  EXPECT_LE(heap.charged_bytes(), 2 * kMiB);  // about 3 MiB held, 2 of them the allowance
  EXPECT_EQ(moved, 3 * kMiB) << "the charge the scope no longer needs passes to the owner";
  EXPECT_EQ(budget->used(), used) << "nothing released in between";
  EXPECT_EQ(budget->used(), heap.charged_bytes() + moved);
  int64_t rest = 0;
  EXPECT_EQ(heap.HandOver(live, &rest), live - 3 * kMiB) << "at most what the scope counts";
  EXPECT_EQ(heap.charged_bytes(), 0);
  EXPECT_EQ(budget->used(), moved + rest);
  budget->Release(moved + rest);  // as the owners would
}

// The runtime's own code called from a body (a collective's meeting, a data op's source) runs with
// the heap paused: neither counted nor refused, however full the device, and the scope counts and
// refuses again once the pause ends.
TEST(BodyHeapTest, APauseLetsTheRuntimesOwnAllocationsThroughUncounted) {
  if (!BodyHeapCountsNew()) GTEST_SKIP() << "a body's operator new is not counted in this build (ThreadSanitizer)";
  auto budget = std::make_shared<MemoryBudget>("cpu:0", 8 * kMiB);
  std::vector<std::string> held;
  ScopedBodyHeap heap(budget, 0);
  {
    const BodyHeapPause runtime;
    EXPECT_FALSE(BodyHeapActive());
    held.emplace_back(16 * kMiB, 'r');  // more than the device's whole memory
    void* block = std::malloc(16 * kMiB);
    ASSERT_NE(block, nullptr);
    std::free(block);
  }
  EXPECT_TRUE(BodyHeapActive());
  EXPECT_LT(heap.live_bytes(), kMiB);
  EXPECT_TRUE(heap.failure().ok()) << heap.failure();
  EXPECT_THROW(std::string(16 * kMiB, 'b'), std::bad_alloc);
  EXPECT_EQ(heap.failure().code(), absl::StatusCode::kResourceExhausted) << heap.failure();
  const BodyHeapPause runtime;  // what was made in a pause is freed in one
  held.clear();
}

}  // namespace
}  // namespace pathways
