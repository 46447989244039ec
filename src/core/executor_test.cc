#include "core/executor.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskScheduledBeforeShutdown) {
  std::atomic<int> ran{0};
  ThreadPool pool("t", 2);
  for (int i = 0; i < 100; ++i) pool.Schedule([&] { ran.fetch_add(1); });
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 100);
  pool.Schedule([&] { ran.fetch_add(1); });  // dropped
  EXPECT_EQ(ran.load(), 100);
}

// Tasks that wait for one another complete: each blocked task got a thread of its own.
TEST(GrowingThreadPoolTest, TasksThatWaitForLaterTasksDoNotDeadlock) {
  GrowingThreadPool pool("g", 16);
  constexpr int kChain = 8;
  std::vector<absl::Notification> done(kChain);
  // Task i waits for task i+1, scheduled after it; the last one waits for nothing.
  for (int i = 0; i < kChain; ++i) {
    pool.Schedule([&done, i] {
      if (i + 1 < kChain) done[i + 1].WaitForNotification();
      done[i].Notify();
    });
  }
  done[0].WaitForNotification();
  EXPECT_LE(pool.threads_started(), kChain);
}

TEST(GrowingThreadPoolTest, StopsGrowingAtItsLimit) {
  GrowingThreadPool pool("g", 3);
  absl::Notification release;
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    pool.Schedule([&] {
      release.WaitForNotification();
      ran.fetch_add(1);
    });
  }
  EXPECT_EQ(pool.threads_started(), 3);
  release.Notify();
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 10);
}

TEST(GrowingThreadPoolTest, TasksScheduledByRunningTasksRunBeforeShutdownEnds) {
  std::atomic<int> ran{0};
  GrowingThreadPool pool("g", 4);
  absl::Notification first;
  pool.Schedule([&] {
    first.WaitForNotification();
    pool.Schedule([&] { ran.fetch_add(1); });
    ran.fetch_add(1);
  });
  first.Notify();
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace pathways
