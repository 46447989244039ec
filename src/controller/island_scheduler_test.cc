#include "controller/island_scheduler.h"

#include <map>

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

}  // namespace
}  // namespace pathways
