#include "core/executor.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/mutex.h"
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
  EXPECT_LE(pool.threads_started(), kChain + 1);  // the blocked tasks' threads and the spare
}

TEST(GrowingThreadPoolTest, StopsGrowingAtItsLimit) {
  GrowingThreadPool pool("g", 3);
  absl::Mutex mu;
  int running = 0;
  absl::Notification release;
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) {
    pool.Schedule([&] {
      {
        absl::MutexLock lock(&mu);
        ++running;
      }
      release.WaitForNotification();
      ran.fetch_add(1);
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(+[](int* r) { return *r == 3; }, &running));
  }
  EXPECT_EQ(pool.threads_started(), 3);  // the other 7 wait in the queue
  release.Notify();
  pool.Shutdown();
  EXPECT_EQ(ran.load(), 10);
}

// One thread takes tasks that never block and finds the spare it started free each time.
TEST(GrowingThreadPoolTest, TasksThatDoNotBlockUseTwoThreads) {
  GrowingThreadPool pool("g", 16);
  for (int i = 0; i < 50; ++i) {
    absl::Notification ran;
    pool.Schedule([&ran] { ran.Notify(); });
    ran.WaitForNotification();
  }
  pool.Shutdown();
  // One thread per task running at once, plus the spare: tasks ran one at a time, but a thread
  // that ran one may not be counted free again yet when the next arrives (3 at most in practice;
  // a pool that started a thread per task would have 50).
  EXPECT_LE(pool.threads_started(), 8);
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
