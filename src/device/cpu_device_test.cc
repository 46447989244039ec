#include "device/cpu_device.h"

#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "core/future.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(CpuDeviceTest, RunsWorkInOrderOnOneThread) {
  CpuDevice device(0, 1 << 20);
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  Promise<Unit> done;
  Future<Unit> finished = done.future();
  for (int i = 0; i < 100; ++i) {
    device.Enqueue([&, i] {
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    });
  }
  device.Enqueue([done = std::move(done)]() mutable { done.Set(Unit{}); });
  ASSERT_TRUE(finished.Await().ok());
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  for (auto& t : threads) EXPECT_EQ(t, threads[0]);
}

TEST(CpuDeviceTest, KeepsARecentTraceWindow) {
  CpuDevice device(0, 1 << 20);
  device.RecordTrace({WorkLabel{"alice", 1, 2, 0, 5, "first"}, 10, 20});
  device.RecordTrace({WorkLabel{"bob", 1, 3, 1, 6, "second"}, 20, 30});
  std::vector<TraceEvent> trace = device.Trace();
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_EQ(device.stats().executed, 2);  // counted with its trace, before its results show
  EXPECT_EQ(device.stats().busy_micros, 20);
  EXPECT_EQ(trace[0].label.name, "first");
  EXPECT_EQ(trace[1].label.client, "bob");
  EXPECT_EQ(device.Trace(25).size(), 1u);
  EXPECT_EQ(device.stats().busy_micros_by_client.at("alice"), 10);
  EXPECT_EQ(device.stats().busy_micros_by_client.at("bob"), 10);
  for (size_t i = 0; i < CpuDevice::kTraceCapacity; ++i) device.RecordTrace({WorkLabel{"c", 0, 0, 0, 0, "x"}, 40, 50});
  EXPECT_EQ(device.Trace().size(), CpuDevice::kTraceCapacity);  // the oldest fell out
  EXPECT_EQ(device.Trace(0)[0].label.client, "c");
}

TEST(CpuDeviceTest, ChargesAndReleasesMemory) {
  CpuDevice device(3, 1000);
  auto a = device.Allocate(DType::kF32, {100});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(device.stats().memory_used, 400);
  auto b = device.Allocate(DType::kF32, {200});  // 800 more: does not fit now
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("cpu:3"), std::string::npos) << b.status();
  a->reset();
  EXPECT_EQ(device.stats().memory_used, 0);
  EXPECT_TRUE(device.Allocate(DType::kF32, {200}).ok());
}

TEST(CpuDeviceTest, WaitsForMemoryToComeBack) {
  CpuDevice device(0, 1000);
  BufferPtr held = *device.Allocate(DType::kF32, {100});
  EXPECT_FALSE(device.WaitForMemoryUsedAtMost(0, absl::Milliseconds(1)));
  std::thread releaser([&] { held.reset(); });
  EXPECT_TRUE(device.WaitForMemoryUsedAtMost(0, absl::Seconds(30)));
  releaser.join();
}

TEST(CpuDeviceTest, AnAllocationThatDoesNotFitWaitsForMemoryToBeReleased) {
  CpuDevice device(0, 1000);
  BufferPtr held = *device.Allocate(DType::kF32, {200});  // 800 of 1000
  auto waited = std::async(std::launch::async, [&] { return device.Allocate(DType::kF32, {100}, absl::Seconds(30)); });
  // While the memory is held the allocation cannot have returned: it fits only once released.
  EXPECT_EQ(waited.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  held.reset();
  auto got = waited.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(device.stats().memory_used, 400);
  // Nobody releases: the bounded wait ends in ResourceExhausted that says it waited.
  BufferPtr more = *device.Allocate(DType::kF32, {100});
  auto starved = device.Allocate(DType::kF32, {100}, absl::Milliseconds(20));
  EXPECT_EQ(starved.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(starved.status().message().find("after waiting"), std::string::npos) << starved.status();
}

TEST(CpuDeviceTest, AllocationLargerThanBudgetNamesSizes) {
  CpuDevice device(0, 1000);
  auto a = device.Allocate(DType::kF64, {1000});
  ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(a.status().message().find("8000 bytes exceeds the device's whole budget of 1000"),
            std::string::npos)
      << a.status();
}

// A kernel's temporary larger than the whole device can never fit: it fails at once, saying so,
// instead of waiting for memory to be released (a 4 TiB torch.empty waited out --memory-wait-ms).
TEST(CpuDeviceTest, ATemporaryLargerThanTheWholeDeviceFailsWithoutWaiting) {
  MemoryBudget budget("cpu:0", 1000, absl::Hours(1));
  const absl::Status charged = budget.Charge(int64_t{4} << 40, budget.kernel_wait());
  EXPECT_EQ(charged.code(), absl::StatusCode::kResourceExhausted) << charged;
  EXPECT_NE(charged.message().find("more than its whole memory (1000 bytes)"), std::string::npos) << charged;
  EXPECT_EQ(budget.used(), 0);
}

TEST(CpuDeviceTest, BufferOutlivingDeviceReleasesSafely) {
  BufferPtr keep;
  {
    CpuDevice device(0, 1000);
    keep = *device.Allocate(DType::kI32, {10});
  }
  keep.reset();  // must not touch the destroyed device
}

}  // namespace
}  // namespace pathways
