// The island control graph with threads in one process: the controller's IslandControlPlane and
// hosts' HostControl, each with its own dataflow service and transport, finding each other in
// the process (no network).
#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "controller/island_control.h"
#include "dataflow/control_graph.h"
#include "dataflow/grpc_transport.h"
#include "gtest/gtest.h"
#include "worker/host_control.h"

namespace pathways {
namespace {

// One process-like party: an address, a dataflow service and transport, a pool.
struct Party {
  explicit Party(std::string address) : address(address), transport(address), pool(address, 2) {
    service.ServeInProcess(address);
  }
  ~Party() { pool.Shutdown(); }
  std::string address;
  dataflow::DataflowService service;
  dataflow::GrpcTransport transport;
  ThreadPool pool;
};

struct Host {
  explicit Host(const std::string& address) : party(address) {
    HostControlOptions options{address, &party.service, &party.transport, &party.pool,
                               [this](std::vector<rpc::ScheduledOp> ops) {
                                 absl::MutexLock lock(&mu);
                                 for (const auto& op : ops) applied.push_back(op.op().seq());
                                 return absl::OkStatus();
                               }};
    control = std::make_unique<HostControl>(options);
  }
  ~Host() { control->Shutdown(); }
  std::vector<int64_t> Applied() {
    absl::MutexLock lock(&mu);
    return applied;
  }
  bool WaitForApplied(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return applied.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  }
  Party party;
  absl::Mutex mu;
  std::vector<int64_t> applied ABSL_GUARDED_BY(mu);  // op seqs, in the order applied
  std::unique_ptr<HostControl> control;
};

rpc::ScheduledOp RunOp(int64_t seq) {
  rpc::ScheduledOp op;
  op.set_client_id("c");
  op.mutable_op()->set_seq(seq);
  op.mutable_op()->mutable_run();
  return op;
}

class ControlGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* h : {"h0", "h1", "h2"}) hosts_[h] = std::make_unique<Host>(h);
    IslandControlOptions options;
    options.island = 0;
    options.controller = controller_.address;
    options.controller_incarnation = "incarnation-1";
    options.transport = &controller_.transport;
    options.service = &controller_.service;
    options.executor = &controller_.pool;
    options.join = [this](const std::string& host, const rpc::ControlGraph& graph) {
      absl::MutexLock lock(&joins_mu_);
      if (held_joins_.contains(host)) {
        held_joins_[host].push_back(graph);
        return Future<Unit>::Ready(Unit{});
      }
      absl::Status joined = hosts_.at(host)->control->Join(graph);
      return joined.ok() ? Future<Unit>::Ready(Unit{}) : Future<Unit>::Ready(joined);
    };
    options.on_done = [this](const rpc::RunDone& done) {
      absl::MutexLock lock(&joins_mu_);
      done_.push_back(done.epoch());
    };
    plane_ = std::make_unique<IslandControlPlane>(options);
  }
  void TearDown() override {
    plane_.reset();
    hosts_.clear();
  }
  void SetMembers(std::vector<std::string> addresses) {
    std::vector<IslandControlPlane::Member> members;
    for (const auto& a : addresses) members.push_back({a, "1"});
    plane_->SetMembers(members);
  }
  // h0 alone in the island, with op 1 applied: its order is under way.
  bool OneHostWithOneOpApplied() {
    SetMembers({"h0"});
    Future<Unit> first = plane_->Push("h0", RunOp(1));
    plane_->EndRound();
    return first.Await().ok();
  }
  // Joins sent to `host` wait until ReleaseJoins.
  void HoldJoins(const std::string& host) {
    absl::MutexLock lock(&joins_mu_);
    held_joins_[host];
  }
  void ReleaseJoins(const std::string& host, bool newest_first = false) {
    std::vector<rpc::ControlGraph> graphs;
    {
      absl::MutexLock lock(&joins_mu_);
      graphs = std::move(held_joins_[host]);
      held_joins_.erase(host);
    }
    if (newest_first) std::reverse(graphs.begin(), graphs.end());
    for (const auto& g : graphs) ASSERT_TRUE(hosts_.at(host)->control->Join(g).ok());
  }

  Party controller_{"ctl"};
  std::map<std::string, std::unique_ptr<Host>> hosts_;
  std::unique_ptr<IslandControlPlane> plane_;
  absl::Mutex joins_mu_;
  std::map<std::string, std::vector<rpc::ControlGraph>> held_joins_ ABSL_GUARDED_BY(joins_mu_);
  std::vector<int64_t> done_ ABSL_GUARDED_BY(joins_mu_);
};

TEST_F(ControlGraphTest, RoundsReachTheirHostsInOrderAndAreAcknowledgedByProgress) {
  SetMembers({"h0", "h1"});
  std::vector<Future<Unit>> acks;
  for (int round = 0; round < 50; ++round) {
    // Some rounds carry nothing for h1: it still learns each round is over.
    acks.push_back(plane_->Push("h0", RunOp(round)));
    if (round % 3 == 0) acks.push_back(plane_->Push("h1", RunOp(round)));
    plane_->EndRound();
  }
  for (auto& a : acks) ASSERT_TRUE(a.Await().ok()) << a.Await().status();
  std::vector<int64_t> all(50), every_third;
  for (int i = 0; i < 50; ++i) all[i] = i;
  for (int i = 0; i < 50; i += 3) every_third.push_back(i);
  EXPECT_EQ(hosts_["h0"]->Applied(), all);
  EXPECT_EQ(hosts_["h1"]->Applied(), every_third);
}

// A round's acknowledgement waits for the hosts it has ops for, and only for them: the island's
// other hosts never hear of it (an announced edge), so a round costs what its hosts cost.
TEST_F(ControlGraphTest, ARoundIsAcknowledgedOnceEveryHostItHasOpsForHasIt) {
  HoldJoins("h1");
  SetMembers({"h0", "h1"});
  Future<Unit> both = plane_->Push("h0", RunOp(1));
  (void)plane_->Push("h1", RunOp(1));  // the round is acknowledged once both hosts have it
  plane_->EndRound();
  ASSERT_TRUE(hosts_["h0"]->WaitForApplied(1));
  // h1 has not joined: the round's batch waits for it there, and so does the acknowledgement.
  EXPECT_EQ(both.AwaitFor(absl::Milliseconds(200)).status().code(), absl::StatusCode::kDeadlineExceeded);
  // A round for h0 alone is acknowledged without h1.
  Future<Unit> only_h0 = plane_->Push("h0", RunOp(2));
  plane_->EndRound();
  EXPECT_TRUE(only_h0.Await().ok());
  ReleaseJoins("h1");
  EXPECT_TRUE(both.Await().ok());
  ASSERT_TRUE(hosts_["h1"]->WaitForApplied(1));
  EXPECT_EQ(hosts_["h1"]->Applied(), (std::vector<int64_t>{1}));
}

TEST_F(ControlGraphTest, AHostLeavingFailsOnlyTheRoundsItWasIn) {
  HoldJoins("h1");  // h1 never takes anything: it is about to go
  SetMembers({"h0", "h1"});
  Future<Unit> only_h0 = plane_->Push("h0", RunOp(1));
  plane_->EndRound();
  Future<Unit> with_h1 = plane_->Push("h1", RunOp(2));
  plane_->EndRound();
  SetMembers({"h0"});
  EXPECT_TRUE(only_h0.Await().ok());
  EXPECT_EQ(with_h1.Await().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(with_h1.Await().status().message().find("h1"), std::string::npos);
  // A host that is not a member is refused at once; the others go on.
  EXPECT_EQ(plane_->Push("h1", RunOp(3)).Await().status().code(), absl::StatusCode::kUnavailable);
  Future<Unit> next = plane_->Push("h0", RunOp(4));
  plane_->EndRound();
  EXPECT_TRUE(next.Await().ok());
  // Acknowledged means h0 has it; it applies it once the op before it (from the older graph,
  // possibly handled later) is in.
  ASSERT_TRUE(hosts_["h0"]->WaitForApplied(2));
  EXPECT_EQ(hosts_["h0"]->Applied(), (std::vector<int64_t>{1, 4}));
}

// Found by a rare failure of MultiProcessTest.AWorkerKilledMidRunFailsItsRunsAndTheRestGoOn (the
// survivor's next call never ran): a round on its way to h0 when h1 leaves. The new generation's
// join reaches h0 before the older generation's batch; that generation must still be in use, or
// h0 drops the batch and waits for its op forever.
TEST_F(ControlGraphTest, ARoundOnItsWayToAHostThatStaysIsNotLostWhenAnotherLeaves) {
  HoldJoins("h0");  // the first generation's batch waits at h0 until it joins
  SetMembers({"h0", "h1"});
  Future<Unit> first = plane_->Push("h0", RunOp(1));
  plane_->EndRound();
  SetMembers({"h0"});
  Future<Unit> second = plane_->Push("h0", RunOp(2));
  plane_->EndRound();
  ReleaseJoins("h0", /*newest_first=*/true);
  EXPECT_TRUE(first.Await().ok());
  EXPECT_TRUE(second.Await().ok());
  ASSERT_TRUE(hosts_["h0"]->WaitForApplied(2));
  EXPECT_EQ(hosts_["h0"]->Applied(), (std::vector<int64_t>{1, 2}));
}

TEST_F(ControlGraphTest, OrderHoldsAcrossGenerations) {
  SetMembers({"h0", "h1"});
  std::vector<Future<Unit>> acks;
  for (int i = 1; i <= 20; ++i) {
    acks.push_back(plane_->Push("h0", RunOp(i)));
    if (i % 5 == 0) {
      // A host joins mid-stream: the next ops travel on a new graph.
      SetMembers(i % 10 == 0 ? std::vector<std::string>{"h0", "h1"} : std::vector<std::string>{"h0", "h1", "h2"});
    }
    plane_->EndRound();
  }
  for (auto& a : acks) ASSERT_TRUE(a.Await().ok());
  // When h2 left, rounds not yet acknowledged stayed pending until h0 had them.
  ASSERT_TRUE(hosts_["h0"]->WaitForApplied(20));
  EXPECT_GE(plane_->generation(), 4);
  std::vector<int64_t> expected;
  for (int i = 1; i <= 20; ++i) expected.push_back(i);
  EXPECT_EQ(hosts_["h0"]->Applied(), expected);
}

TEST_F(ControlGraphTest, OpsThatComeEarlyWaitForThoseBeforeThem) {
  HoldJoins("h0");
  SetMembers({"h0", "h1"});
  std::vector<Future<Unit>> acks;
  for (int i = 1; i <= 3; ++i) acks.push_back(plane_->Push("h0", RunOp(i)));
  plane_->EndRound();
  SetMembers({"h0", "h1", "h2"});
  for (int i = 4; i <= 6; ++i) acks.push_back(plane_->Push("h0", RunOp(i)));
  plane_->EndRound();
  // h0 joins the second generation first: its ops come before the first generation's.
  ReleaseJoins("h0", /*newest_first=*/true);
  for (auto& a : acks) ASSERT_TRUE(a.Await().ok());
  EXPECT_EQ(hosts_["h0"]->Applied(), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
}

TEST_F(ControlGraphTest, HostsLetGoOfGraphsTheControllerNoLongerUses) {
  for (int i = 1; i <= 10; ++i) {
    SetMembers(i % 2 == 0 ? std::vector<std::string>{"h0", "h1"} : std::vector<std::string>{"h0", "h2"});
    Future<Unit> ack = plane_->Push("h0", RunOp(i));
    plane_->EndRound();
    ASSERT_TRUE(ack.Await().ok());
  }
  // Every round was acknowledged before the next generation began: each new graph told h0 that
  // the ones before it were out of use.
  EXPECT_EQ(hosts_["h0"]->control->num_generations(), 1u);
  EXPECT_LE(hosts_["h1"]->control->num_generations(), 1u);
}

TEST_F(ControlGraphTest, HostsReportRunsDoneThroughTheGraph) {
  SetMembers({"h0", "h1"});
  for (int64_t epoch : {7, 8, 9}) {
    rpc::RunDone done;
    done.set_client_id("c");
    done.set_epoch(epoch);
    hosts_[epoch == 8 ? "h1" : "h0"]->control->ReportDone(done);
  }
  absl::MutexLock lock(&joins_mu_);
  auto all_in = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(joins_mu_) { return done_.size() == 3; };
  ASSERT_TRUE(joins_mu_.AwaitWithTimeout(absl::Condition(&all_in), absl::Seconds(30)));
  std::vector<int64_t> got = done_;
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int64_t>{7, 8, 9}));
}

// An op that cannot be read has an unknown place in the order, so the host cannot go on: it says
// so (the worker then leaves the island). Garbage from a controller gone since changes nothing.
TEST_F(ControlGraphTest, AnUnreadableOpBreaksTheHostsOrderAndSaysSo) {
  ASSERT_TRUE(OneHostWithOneOpApplied());
  HostControl& h0 = *hosts_["h0"]->control;
  EXPECT_TRUE(h0.Broken().ok());
  h0.TEST_OnScheduled("an-older-incarnation", "\xff\xff not a proto");
  EXPECT_TRUE(h0.Broken().ok());
  h0.TEST_OnScheduled("incarnation-1", "\xff\xff not a proto");
  const absl::Status broken = h0.Broken();
  EXPECT_EQ(broken.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(broken.message().find("host h0: a scheduled op from controller incarnation-1 could not be read"),
            std::string::npos)
      << broken;
  EXPECT_EQ(hosts_["h0"]->Applied(), (std::vector<int64_t>{1}));
  // A controller that restarted starts a new order: the host is whole again.
  rpc::ControlGraph next;
  next.set_controller("ctl");
  next.set_controller_incarnation("incarnation-2");
  next.set_generation(1);
  next.add_hosts("h0");
  ASSERT_TRUE(h0.Join(next).ok());
  EXPECT_TRUE(h0.Broken().ok()) << h0.Broken();
}

// A generation that lost a batch from the controller before the host joined it may have lost
// scheduled ops, whose place in the order is then unknown: the host says so and leaves, as for
// an op it cannot read. A batch dropped from anyone outside the graph changes nothing.
TEST_F(ControlGraphTest, AGenerationThatLostBatchesBeforeTheJoinBreaksTheHostsOrder) {
  ASSERT_TRUE(OneHostWithOneOpApplied());
  HostControl& h0 = *hosts_["h0"]->control;
  rpc::ControlGraph next;
  next.set_controller("ctl");
  next.set_controller_incarnation("incarnation-1");
  next.set_generation(7);
  next.add_hosts("h0");
  dataflow::DataflowService& service = hosts_["h0"]->party.service;
  service.SetHoldLimits(/*bytes=*/1 << 20, /*bytes_per_graph=*/1 << 20, /*bytes_per_peer=*/100);
  dataflow::Envelope e;
  e.epoch = 3;
  e.payload.assign(200, 'x');
  service.Receive("a stranger", dataflow::ControlGraphName(next), {e});  // dropped, not the graph's
  ASSERT_TRUE(h0.Join(next).ok());
  EXPECT_TRUE(h0.Broken().ok()) << h0.Broken();
  next.set_generation(8);
  service.Receive("ctl", dataflow::ControlGraphName(next), {e});  // dropped, from the controller
  ASSERT_TRUE(h0.Join(next).ok());
  const absl::Status broken = h0.Broken();
  EXPECT_EQ(broken.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(broken.message().find("control generation 8 lost batches before this host joined it"),
            std::string::npos)
      << broken;
  EXPECT_NE(broken.message().find("from ctl came before the graph was set up"), std::string::npos) << broken;
}

// Ops that wait for one that never comes are bounded in time: past the bound the host says its
// order is lost (the worker, asking at its heartbeats, then leaves) instead of waiting silently.
TEST_F(ControlGraphTest, OpsWaitingTooLongForOneThatNeverComesBreakTheHostsOrder) {
  Host h("h9");
  HostControlOptions options{"h9", &h.party.service, &h.party.transport, &h.party.pool,
                             [](std::vector<rpc::ScheduledOp>) { return absl::OkStatus(); }};
  options.early_wait = absl::Milliseconds(50);
  HostControl control(options);
  rpc::ControlGraph graph;
  graph.set_island(0);
  graph.set_generation(1);
  graph.set_controller(controller_.address);
  graph.set_controller_incarnation("incarnation-1");
  graph.add_hosts("h9");
  ASSERT_TRUE(control.Join(graph).ok());
  rpc::ScheduledOp op = RunOp(2);
  op.set_order(2);  // order 1 never comes
  control.TEST_OnScheduled("incarnation-1", op.SerializeAsString());
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (control.Broken().ok() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));  // time is the condition
  EXPECT_EQ(control.Broken().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(control.Broken().message().find("scheduled op 1 never came within 50ms while 1 later ones waited"),
            std::string::npos)
      << control.Broken();
  control.Shutdown();
}

// Ops that wait for one that never comes are bounded: past the bound the host says its order is
// lost instead of holding them all.
TEST_F(ControlGraphTest, OpsWaitingForOneThatNeverComesAreBounded) {
  ASSERT_TRUE(OneHostWithOneOpApplied());
  HostControl& h0 = *hosts_["h0"]->control;
  // Order 2 never comes; 3, 4, ... wait for it.
  for (int64_t order = 3; order < static_cast<int64_t>(HostControl::kMaxEarlyOps) + 3; ++order) {
    rpc::ScheduledOp op = RunOp(order);
    op.set_order(order);
    h0.TEST_OnScheduled("incarnation-1", op.SerializeAsString());
  }
  EXPECT_TRUE(h0.Broken().ok());  // exactly the bound: still waiting
  rpc::ScheduledOp one_more = RunOp(1);
  one_more.set_order(static_cast<int64_t>(HostControl::kMaxEarlyOps) + 3);
  h0.TEST_OnScheduled("incarnation-1", one_more.SerializeAsString());
  EXPECT_EQ(h0.Broken().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(h0.Broken().message().find("scheduled op 2 never came"), std::string::npos) << h0.Broken();
}

TEST_F(ControlGraphTest, MalformedGraphsAreRefused) {
  rpc::ControlGraph graph;
  graph.set_controller("ctl");
  EXPECT_EQ(hosts_["h0"]->control->Join(graph).code(), absl::StatusCode::kInvalidArgument);  // no hosts
  graph.add_hosts("h1");
  EXPECT_EQ(hosts_["h0"]->control->Join(graph).code(), absl::StatusCode::kInvalidArgument);  // not h0's
  graph.add_hosts("h1");
  EXPECT_EQ(hosts_["h0"]->control->Join(graph).code(), absl::StatusCode::kInvalidArgument);  // h1 twice
}

}  // namespace
}  // namespace pathways
