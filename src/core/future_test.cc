#include "core/future.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(FutureTest, ValueSetBeforeAndAfterCallback) {
  Promise<int> p;
  Future<int> f = p.future();
  EXPECT_FALSE(f.IsReady());
  int seen = 0;
  f.OnReady([&](const absl::StatusOr<int>& r) { seen = *r; });
  p.Set(7);
  EXPECT_TRUE(f.IsReady());
  EXPECT_EQ(seen, 7);
  int seen_late = 0;
  f.OnReady([&](const absl::StatusOr<int>& r) { seen_late = *r; });
  EXPECT_EQ(seen_late, 7);
  EXPECT_EQ(*f.Await(), 7);
}

TEST(FutureTest, ErrorPropagatesThroughThen) {
  Promise<int> p;
  bool called = false;
  Future<int> g = p.future().Then([&](const int& v) {
    called = true;
    return v + 1;
  });
  p.Set(absl::InvalidArgumentError("bad"));
  EXPECT_FALSE(called);
  EXPECT_EQ(g.Await().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FutureTest, ThenMayReturnStatusOr) {
  Future<int> f = Future<int>::Ready(3);
  Future<int> g = f.Then([](const int& v) -> absl::StatusOr<int> {
    if (v > 2) return absl::OutOfRangeError("too big");
    return v;
  });
  EXPECT_EQ(g.Await().status().code(), absl::StatusCode::kOutOfRange);
}

TEST(FutureTest, FlatThenChainsAsynchronousSteps) {
  Promise<int> first;
  Promise<std::string> second;
  Future<std::string> second_future = second.future();
  Future<std::string> chained = first.future().FlatThen([&](const int& v) {
    EXPECT_EQ(v, 4);
    return second_future;
  });
  first.Set(4);
  EXPECT_FALSE(chained.IsReady());
  second.Set("done");
  EXPECT_EQ(*chained.Await(), "done");

  Promise<int> failing;
  Future<int> skipped = failing.future().FlatThen([](const int&) -> Future<int> {
    ADD_FAILURE() << "must not run";
    return Future<int>::Ready(0);
  });
  failing.Set(absl::NotFoundError("gone"));
  EXPECT_EQ(skipped.Await().status().code(), absl::StatusCode::kNotFound);
}

TEST(FutureTest, DroppedPromiseCancels) {
  Future<int> f;
  {
    Promise<int> p;
    f = p.future();
  }
  EXPECT_EQ(f.Await().status().code(), absl::StatusCode::kCancelled);
}

TEST(FutureTest, AwaitForTimesOut) {
  Promise<int> p;
  EXPECT_EQ(p.future().AwaitFor(absl::Milliseconds(5)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(FutureTest, SetFromManyThreadsRunsEveryCallbackOnce) {
  constexpr int kFutures = 200;
  std::vector<Promise<int>> promises(kFutures);
  std::atomic<int> calls{0};
  for (auto& p : promises) {
    p.future().OnReady([&](const absl::StatusOr<int>&) { calls++; });
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kFutures; i += 4) promises[i].Set(i);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.load(), kFutures);
}

TEST(FutureTest, JoinAllKeepsOrderAndFailsFast) {
  Promise<int> a, b;
  Future<std::vector<int>> all = JoinAll<int>({a.future(), b.future()});
  b.Set(2);
  EXPECT_FALSE(all.IsReady());
  a.Set(1);
  EXPECT_EQ(*all.Await(), (std::vector<int>{1, 2}));

  Promise<int> c, d;
  Future<std::vector<int>> failed = JoinAll<int>({c.future(), d.future()});
  c.Set(absl::UnavailableError("host gone"));
  EXPECT_TRUE(failed.IsReady());
  EXPECT_EQ(failed.Await().status().code(), absl::StatusCode::kUnavailable);
}

TEST(FutureTest, OnReadyWithExecutorRunsOnPool) {
  ThreadPool pool("test", 1);
  Promise<int> p;
  Promise<std::thread::id> ran_on;
  Future<std::thread::id> ran = ran_on.future();
  p.future().OnReady(pool, [&ran_on](const absl::StatusOr<int>&) mutable {
    ran_on.Set(std::this_thread::get_id());
  });
  p.Set(1);
  EXPECT_NE(*ran.Await(), std::this_thread::get_id());
  // The callback may still be inside ran_on.Set (which wakes this thread before it returns):
  // the pool finishes it before ran_on goes out of scope (ASan saw the race).
  pool.Shutdown();
}

}  // namespace
}  // namespace pathways

namespace pathways {
namespace {

// Counts its copies.
struct Counted {
  static inline int copies = 0;
  Counted() = default;
  Counted(const Counted&) { ++copies; }
  Counted(Counted&&) = default;
  Counted& operator=(const Counted&) {
    ++copies;
    return *this;
  }
  Counted& operator=(Counted&&) = default;
};

TEST(FutureTakeTest, MovesTheValueOutOnlyWhenNoOtherCopyCanSeeIt) {
  Promise<Counted> p;
  Future<Counted> f = p.future();
  Future<Counted> other = f;
  EXPECT_FALSE(f.WaitFor(absl::Milliseconds(1)));
  p.Set(Counted());
  EXPECT_TRUE(f.WaitFor(absl::Milliseconds(1)));
  Counted::copies = 0;
  // Another copy can still read the value: Take copies it.
  EXPECT_TRUE(std::move(f).Take().ok());
  EXPECT_EQ(Counted::copies, 1);
  // The last one moves it out.
  EXPECT_TRUE(std::move(other).Take().ok());
  EXPECT_EQ(Counted::copies, 1);
  Promise<int> failed;
  Future<int> g = failed.future();
  failed.Set(absl::NotFoundError("gone"));
  EXPECT_EQ(std::move(g).Take().status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pathways
