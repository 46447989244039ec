#include "controller/island_scheduler.h"

#include <map>
#include <thread>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// Records what each host was sent, in order, and accepts it at once.
class RecordingSink : public ScheduledOpSink {
 public:
  Future<Unit> Push(const std::string& host, rpc::ScheduledOp op) override {
    absl::MutexLock lock(&mu_);
    sent_[host].push_back(op);
    return Future<Unit>::Ready(Unit{});
  }
  std::vector<rpc::ScheduledOp> sent(const std::string& host) {
    absl::MutexLock lock(&mu_);
    return sent_[host];
  }
  // False if the host has not been sent `n` ops within `timeout`.
  bool WaitForSent(const std::string& host, size_t n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sent_[host].size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<rpc::ScheduledOp>> sent_;
};

rpc::GangRun GangRunOn(int64_t epoch, std::vector<std::string> hosts, int64_t seq) {
  rpc::GangRun run;
  run.mutable_run()->set_epoch(epoch);
  for (const std::string& h : hosts) {
    rpc::HostSeq* hs = run.add_hosts();
    hs->set_host(h);
    hs->set_seq(seq);
  }
  return run;
}

TEST(IslandSchedulerTest, FifoGivesEveryHostTheSameOrder) {
  RecordingSink sink;
  IslandScheduler scheduler(0, {}, sink);
  // Two clients interleave runs over overlapping host sets.
  for (int64_t i = 1; i <= 20; ++i) {
    ASSERT_TRUE(scheduler.Submit("a", 1, {GangRunOn(i, {"h0", "h1"}, i)}).Await().ok());
    ASSERT_TRUE(scheduler.Submit("b", 1, {GangRunOn(i, {"h1", "h0", "h2"}, i)}).Await().ok());
  }
  auto order = [&](const std::string& host) {
    std::vector<std::string> o;
    for (const rpc::ScheduledOp& op : sink.sent(host)) o.push_back(absl::StrCat(op.client_id(), op.op().run().epoch()));
    return o;
  };
  EXPECT_EQ(order("h0"), order("h1"));
  EXPECT_EQ(order("h0").size(), 40u);
  EXPECT_EQ(sink.sent("h2").size(), 20u);
  EXPECT_EQ(sink.sent("h0")[0].op().seq(), 1);  // each host gets the client's sequence number for it
  EXPECT_FALSE(sink.sent("h0")[0].op().run().report_done());
}

TEST(IslandSchedulerTest, ProportionalShareReleasesDeviceTimeByWeight) {
  RecordingSink sink;
  IslandScheduler scheduler(0, {.policy = SchedulingPolicy::kProportionalShare, .window = absl::Milliseconds(1)},
                            sink);
  // Three backlogged clients, weights 1:2:4, each run taking 300 us of device time.
  const std::map<std::string, double> weights = {{"a", 1}, {"b", 2}, {"c", 4}};
  for (const auto& [client, weight] : weights) {
    std::vector<rpc::GangRun> runs;
    for (int64_t i = 1; i <= 200; ++i) runs.push_back(GangRunOn(i, {"h0"}, i));
    ASSERT_TRUE(scheduler.Submit(client, weight, std::move(runs)).Await().ok());  // queued, not all sent
  }
  // Play the host: finish runs in the order they went out, as the window lets more out.
  size_t finished = 0;
  for (int step = 0; step < 280; ++step) {
    std::vector<rpc::ScheduledOp> sent = sink.sent("h0");
    ASSERT_LT(finished, sent.size()) << "the window let nothing out";
    EXPECT_TRUE(sent[finished].op().run().report_done());
    scheduler.Done(sent[finished].client_id(), sent[finished].op().run().epoch(), 300);
    ++finished;
  }
  // Client a was alone for its first runs (the window let them out before b and c came); from
  // then on, 210 runs split 1:2:4 are 30:60:120.
  std::map<std::string, int> count;
  for (size_t i = 70; i < finished; ++i) ++count[sink.sent("h0")[i].client_id()];
  EXPECT_NEAR(count["a"], 30, 2);
  EXPECT_NEAR(count["b"], 60, 2);
  EXPECT_NEAR(count["c"], 120, 2);
}

TEST(IslandSchedulerTest, ALostDoneReportDoesNotStallTheIsland) {
  RecordingSink sink;
  IslandScheduler scheduler(0,
                            {.policy = SchedulingPolicy::kProportionalShare, .window = absl::Microseconds(1),
                             .done_timeout = absl::Milliseconds(50)},
                            sink);
  std::vector<rpc::GangRun> runs;
  for (int64_t i = 1; i <= 3; ++i) runs.push_back(GangRunOn(i, {"h0"}, i));
  ASSERT_TRUE(scheduler.Submit("a", 1, std::move(runs)).Await().ok());
  EXPECT_EQ(sink.sent("h0").size(), 1u);  // the window holds one run at a time
  // No Done ever comes; the scheduler stops waiting for each run after 50 ms and sends the next.
  EXPECT_TRUE(sink.WaitForSent("h0", 3, absl::Seconds(30)));
}

// Two islands, each with its scheduler and hosts, sharing one cross-island order.
struct TwoIslands {
  explicit TwoIslands(IslandSchedulerOptions options)
      : island0(0, options, sink0), island1(1, options, sink1) {}
  IslandScheduler& island(int i) { return i == 0 ? island0 : island1; }
  // `client`'s run `epoch` over both islands, parts submitted in the given island order.
  std::vector<Future<Unit>> SubmitAcross(const std::string& client, int64_t epoch, int first) {
    auto run = std::make_shared<CrossIslandRun>(order, 2);
    std::vector<Future<Unit>> accepted;
    for (int i : {first, 1 - first}) {
      accepted.push_back(island(i).Submit(client, 1, {GangRunOn(epoch, i == 0 ? std::vector<std::string>{"h0", "h1"}
                                                                             : std::vector<std::string>{"g0", "g1"},
                                                             epoch)},
                                          run));
    }
    return accepted;
  }
  // The runs over both islands, in the order `host` got them.
  std::vector<std::string> Order(const std::string& host) {
    RecordingSink& sink = host[0] == 'h' ? sink0 : sink1;
    std::vector<std::string> o;
    for (const rpc::ScheduledOp& op : sink.sent(host)) {
      if (op.op().run().epoch() < 1000) o.push_back(absl::StrCat(op.client_id(), op.op().run().epoch()));
    }
    return o;
  }
  CrossIslandOrder order;
  RecordingSink sink0, sink1;
  IslandScheduler island0, island1;
};

class CrossIslandSchedulingTest : public ::testing::TestWithParam<SchedulingPolicy> {};

TEST_P(CrossIslandSchedulingTest, RunsOverTwoIslandsHaveOneOrderOnBoth) {
  // A wide window: proportional share lets everything out without done reports.
  TwoIslands islands({.policy = GetParam(), .window = absl::Seconds(100)});
  // Two clients at once, each reaching the islands in the opposite order, with runs within one
  // island (epochs from 1000) in between.
  auto client = [&](const std::string& id, int first) {
    std::vector<Future<Unit>> accepted;
    for (int64_t e = 1; e <= 200; ++e) {
      for (auto& f : islands.SubmitAcross(id, e, first)) accepted.push_back(f);
      if (e % 3 == 0) accepted.push_back(islands.island(e % 2).Submit(id, 1, {GangRunOn(1000 + e, {"h0", "g0"}, e)}));
    }
    return AllDone(accepted).Await().status();
  };
  absl::Status a, b;
  std::thread ta([&] { a = client("a", 0); });
  std::thread tb([&] { b = client("b", 1); });
  ta.join();
  tb.join();
  ASSERT_TRUE(a.ok()) << a;
  ASSERT_TRUE(b.ok()) << b;
  EXPECT_EQ(islands.Order("h0").size(), 400u);
  EXPECT_EQ(islands.Order("h0"), islands.Order("h1"));
  EXPECT_EQ(islands.Order("h0"), islands.Order("g0"));
  EXPECT_EQ(islands.Order("g0"), islands.Order("g1"));
}

TEST_P(CrossIslandSchedulingTest, AReachedPartHoldsTheClientsLaterRunsUntilEveryIslandReachesIt) {
  TwoIslands islands({.policy = GetParam(), .window = absl::Seconds(100)});
  auto run = std::make_shared<CrossIslandRun>(islands.order, 2);
  Future<Unit> part0 = islands.island0.Submit("a", 1, {GangRunOn(1, {"h0"}, 1)}, run);
  Future<Unit> later = islands.island0.Submit("a", 1, {GangRunOn(1001, {"h0"}, 2)});
  Future<Unit> other = islands.island0.Submit("b", 1, {GangRunOn(1002, {"h0"}, 1)});
  ASSERT_TRUE(other.Await().ok());
  // Client b's run went out; client a's part waits for island 1, and a's later run behind it.
  ASSERT_EQ(islands.sink0.sent("h0").size(), 1u);
  EXPECT_EQ(islands.sink0.sent("h0")[0].client_id(), "b");
  ASSERT_TRUE(islands.island1.Submit("a", 1, {GangRunOn(1, {"g0"}, 1)}, run).Await().ok());
  ASSERT_TRUE(part0.Await().ok());
  ASSERT_TRUE(later.Await().ok());
  ASSERT_EQ(islands.sink0.sent("h0").size(), 3u);
  EXPECT_EQ(islands.sink0.sent("h0")[1].op().run().epoch(), 1);
  EXPECT_EQ(islands.sink0.sent("h0")[2].op().run().epoch(), 1001);
  EXPECT_EQ(islands.sink1.sent("g0").size(), 1u);
}

TEST_P(CrossIslandSchedulingTest, AClientRetiredWhileItsPartWaitsHearsCancelled) {
  TwoIslands islands({.policy = GetParam(), .window = absl::Seconds(100)});
  auto run = std::make_shared<CrossIslandRun>(islands.order, 2);
  Future<Unit> part0 = islands.island0.Submit("a", 1, {GangRunOn(1, {"h0"}, 1)}, run);
  islands.island0.RetireClient("a", {"h0"});
  islands.island1.RetireClient("a", {"g0"});
  // Under proportional share the part was accepted when queued; under FIFO it hears why not.
  const absl::Status status = part0.Await().status();
  if (GetParam() == SchedulingPolicy::kFifo) {
    EXPECT_TRUE(absl::IsCancelled(status)) << status;
  }
  // The other island's part, reached after the retirement, is dropped, never sent.
  (void)islands.island1.Submit("a", 1, {GangRunOn(1, {"g0"}, 1)}, run).Await();
  for (const rpc::ScheduledOp& op : islands.sink1.sent("g0")) EXPECT_FALSE(op.op().has_run()) << "a run was sent";
}

TEST(CrossIslandOrderTest, AClosedOrderSendsNothing) {
  CrossIslandOrder order;
  int sent = 0;
  order.Ready({[&] { ++sent; }});
  EXPECT_EQ(sent, 1);
  order.Close();
  order.Ready({[&] { ++sent; }});
  EXPECT_EQ(sent, 1);
}

INSTANTIATE_TEST_SUITE_P(Policies, CrossIslandSchedulingTest,
                         ::testing::Values(SchedulingPolicy::kFifo, SchedulingPolicy::kProportionalShare),
                         [](const auto& info) { return info.param == SchedulingPolicy::kFifo ? "Fifo" : "Share"; });

}  // namespace
}  // namespace pathways
