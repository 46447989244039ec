#include <functional>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "dataflow/engine.h"
#include "dataflow/dataflow_service.h"
#include "dataflow/grpc_transport.h"
#include "testing/sparse_sum_graph.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

namespace pathways::dataflow {
namespace {

constexpr int kEpochs = 5;
constexpr uint32_t kSeed = 11;

// 6 bucket counts and 2 sink totals per epoch; buckets 3..5 never get a message but finish.
void CheckResults(SparseSumResults& results, const std::map<int64_t, std::pair<int64_t, int64_t>>& expected) {
  for (const auto& [e, sinks] : expected) {
    for (int b = 3; b < 6; ++b) EXPECT_EQ(results.Get(absl::StrCat("bucket", b, "/e", e, "/count")), 0);
    EXPECT_EQ(results.Get(absl::StrCat("sink0/e", e)), sinks.first) << "epoch " << e;
    EXPECT_EQ(results.Get(absl::StrCat("sink1/e", e)), sinks.second) << "epoch " << e;
    if (e % 2 == 0) {  // even epochs carry only multiples of 3: only bucket 0 hears anything
      EXPECT_EQ(results.Get(absl::StrCat("bucket1/e", e, "/count")), 0);
      EXPECT_EQ(results.Get(absl::StrCat("bucket2/e", e, "/count")), 0);
    }
  }
}

TEST(DataflowTest, ThreeHostsAsThreadsWithOverlappingEpochs) {
  std::vector<std::string> hosts = {"h0", "h1", "h2"};
  auto graph = MakeSparseSumGraph(hosts);
  SparseSumResults results;
  LocalTransport transport;
  std::vector<std::unique_ptr<ThreadPool>> pools;
  std::vector<std::shared_ptr<Engine>> engines;
  for (const auto& h : hosts) {
    pools.push_back(std::make_unique<ThreadPool>(h, 2));
    engines.push_back(std::make_shared<Engine>(h, graph, SparseSumOperators(results), transport, *pools.back()));
    transport.Register(engines.back().get());
  }
  std::map<int64_t, std::pair<int64_t, int64_t>> expected;
  for (auto& e : engines) expected = DriveSparseSum(*e, kEpochs, kSeed);
  ASSERT_TRUE(results.WaitFor(8 * kEpochs, absl::Seconds(30))) << results.size();
  CheckResults(results, expected);
  int64_t envelopes = 0, batches = 0;
  for (auto& e : engines) {
    envelopes += e->envelopes_sent();
    batches += e->batches_sent();
  }
  EXPECT_GT(envelopes, batches);  // envelopes to a host travel together
  for (auto& p : pools) p->Shutdown();
}

TEST(DataflowTest, AllShardsOnOneHostStayInMemory) {
  auto graph = MakeSparseSumGraph({"h", "h", "h"});
  SparseSumResults results;
  LocalTransport transport;
  ThreadPool pool("h", 2);
  auto engine = std::make_shared<Engine>("h", graph, SparseSumOperators(results), transport, pool);
  transport.Register(engine.get());
  auto expected = DriveSparseSum(*engine, kEpochs, kSeed);
  ASSERT_TRUE(results.WaitFor(8 * kEpochs, absl::Seconds(30)));
  CheckResults(results, expected);
  EXPECT_EQ(engine->batches_sent(), 0);
  pool.Shutdown();
}

// Three hosts with gRPC transports in this process, host 2 registering its engine only after
// the others have sent everything: what reached it before is held and handed over on
// registration. With `in_process`, the hosts find each other in this process and skip the
// network; with `streams`, they have stream listeners and batches go over plain TCP instead of
// gRPC. Returns (messages written to the network, batches handed over in the process, batches
// that came over plain TCP).
struct Traffic {
  int64_t written = 0, in_process = 0, streamed = 0;
};
Traffic RunThreeGrpcHostsOneJoiningLate(bool in_process, bool streams = false) {
  std::vector<std::unique_ptr<LoopbackDataflowHost>> servers;
  for (int i = 0; i < 3; ++i) {
    auto h = StartLoopbackDataflowHost(streams);
    EXPECT_TRUE(h.ok()) << h.status();
    if (!h.ok()) return {-1, -1, -1};
    if (in_process) (*h)->service.ServeInProcess((*h)->address);
    servers.push_back(*std::move(h));
  }
  std::vector<std::string> hosts = {servers[0]->address, servers[1]->address, servers[2]->address};
  auto graph = MakeSparseSumGraph(hosts);
  SparseSumResults results;
  std::vector<std::unique_ptr<ThreadPool>> pools;
  std::vector<std::unique_ptr<GrpcTransport>> transports;
  std::vector<std::shared_ptr<Engine>> engines;
  for (int i = 0; i < 3; ++i) {
    pools.push_back(std::make_unique<ThreadPool>("h", 2));
    transports.push_back(std::make_unique<GrpcTransport>(hosts[i]));
    engines.push_back(std::make_shared<Engine>(hosts[i], graph, SparseSumOperators(results), *transports[i], *pools[i]));
  }
  (void)servers[0]->service.AddEngine(engines[0].get());
  (void)servers[1]->service.AddEngine(engines[1].get());
  std::map<int64_t, std::pair<int64_t, int64_t>> expected;
  expected = DriveSparseSum(*engines[0], kEpochs, kSeed);
  expected = DriveSparseSum(*engines[1], kEpochs, kSeed);
  (void)servers[2]->service.AddEngine(engines[2].get());
  expected = DriveSparseSum(*engines[2], kEpochs, kSeed);
  EXPECT_TRUE(results.WaitFor(8 * kEpochs, absl::Seconds(30))) << results.size();
  CheckResults(results, expected);
  Traffic traffic;
  for (auto& t : transports) {
    traffic.written += t->messages_written();
    traffic.in_process += t->batches_in_process();
  }
  for (auto& s : servers) traffic.streamed += s->service.batches_streamed();
  for (int i = 0; i < 3; ++i) servers[i]->service.RemoveEngine(engines[i]->graph().name());
  // Trailing punctuations may still be queued on the pools, and they send through the transports
  // (UBSan caught one sending through a transport already destroyed): stop the engines, then
  // their pools, then the transports, whose streams finish before the servers go.
  for (auto& e : engines) e->Shutdown();
  for (auto& p : pools) p->Shutdown();
  transports.clear();
  servers.clear();
  return traffic;
}

TEST(DataflowTest, ThreeHostsOverGrpcStreamsInOneProcessOneJoiningLate) {
  Traffic t = RunThreeGrpcHostsOneJoiningLate(/*in_process=*/false);
  EXPECT_GT(t.written, 0);
  EXPECT_EQ(t.in_process, 0);
  EXPECT_EQ(t.streamed, 0);  // no stream listeners: gRPC
}

TEST(DataflowTest, ThreeHostsOverPlainTcpStreamsOneJoiningLate) {
  Traffic t = RunThreeGrpcHostsOneJoiningLate(/*in_process=*/false, /*streams=*/true);
  EXPECT_GT(t.written, 0);
  EXPECT_EQ(t.in_process, 0);
  EXPECT_GT(t.streamed, 0);
}

TEST(DataflowTest, HostsSharingAProcessSkipTheNetwork) {
  Traffic t = RunThreeGrpcHostsOneJoiningLate(/*in_process=*/true);
  EXPECT_EQ(t.written, 0);
  EXPECT_GT(t.in_process, 0);
}

std::vector<Envelope> Batch(size_t payload) {
  Envelope e;
  e.payload.assign(payload, 'x');
  return {e};
}

// Polls `done` until it holds or 30 s pass.
bool Eventually(const std::function<bool()>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// What waits for a peer is accounted until it is written, over gRPC and over plain TCP streams:
// a peer that takes everything is never named as stalled.
TEST(GrpcTransportTest, WhatAPeerTookNoLongerWaits) {
  for (bool streams : {false, true}) {
    auto peer = StartLoopbackDataflowHost(streams);
    ASSERT_TRUE(peer.ok()) << peer.status();
    GrpcTransport transport("me");
    for (int i = 0; i < 50; ++i) transport.Send((*peer)->address, "g", Batch(1000));
    EXPECT_TRUE(Eventually([&] { return transport.Stalled(absl::ZeroDuration()).empty(); })) << streams;
  }
}

// A peer that takes nothing (here: nobody listens at its address) is named once what waits for it
// went nowhere for the limit; past the byte bound its batches are refused, and it is named for
// that, until the host is forgotten.
TEST(GrpcTransportTest, APeerThatTakesNothingIsNamedAndBounded) {
  std::string address;
  {
    auto gone = StartLoopbackDataflowHost();  // its address, where nobody listens once it went
    ASSERT_TRUE(gone.ok()) << gone.status();
    address = (*gone)->address;
  }
  GrpcTransport transport("me");
  transport.SetMaxPeerBytes(10000);
  transport.Send(address, "g", Batch(3000));
  std::vector<GrpcTransport::PeerBacklog> stalled;
  ASSERT_TRUE(Eventually([&] {
    stalled = transport.Stalled(absl::Milliseconds(200));
    return !stalled.empty();
  }));
  ASSERT_EQ(stalled.size(), 1u);
  EXPECT_EQ(stalled[0].host, address);
  EXPECT_GE(stalled[0].bytes, 3000);
  EXPECT_GE(stalled[0].stalled, absl::Milliseconds(200));
  EXPECT_FALSE(stalled[0].refused);
  transport.Send(address, "g", Batch(3000));
  transport.Send(address, "g", Batch(3000));
  EXPECT_EQ(transport.refused_batches(), 0);
  transport.Send(address, "g", Batch(3000));  // past 10000 bytes: refused, and the peer named for it
  EXPECT_EQ(transport.refused_batches(), 1);
  stalled = transport.Stalled(absl::Hours(1));
  ASSERT_EQ(stalled.size(), 1u);
  EXPECT_TRUE(stalled[0].refused);

  // The host left the cluster: what waited for it goes, and so does its refusal; a batch for the
  // address afterwards (a new worker there) starts afresh.
  transport.Forget(address);
  EXPECT_TRUE(transport.Stalled(absl::ZeroDuration()).empty());
  transport.Send(address, "g", Batch(3000));
  EXPECT_EQ(transport.refused_batches(), 1);
  stalled = transport.Stalled(absl::ZeroDuration());
  ASSERT_EQ(stalled.size(), 1u);
  EXPECT_FALSE(stalled[0].refused);
  EXPECT_LT(stalled[0].bytes, 6000);
}

TEST(DataflowTest, ThreeHostsAsRealProcesses) {
  // This process is host 0; two dataflow_peer processes are hosts 1 and 2.
  auto self = StartLoopbackDataflowHost();
  ASSERT_TRUE(self.ok()) << self.status();
  std::vector<std::string> hosts = {(*self)->address};
  Subprocess peers[2];
  for (auto& p : peers) {
    ASSERT_TRUE(p.Start({DATAFLOW_PEER, std::to_string(kEpochs)}).ok());
    auto line = p.WaitForLine("address ", absl::Seconds(30));
    ASSERT_TRUE(line.ok()) << line.status();
    hosts.push_back(line->substr(8));
  }
  SparseSumResults results;
  ThreadPool pool("h0", 2);
  auto transport = std::make_unique<GrpcTransport>(hosts[0]);
  auto engine = std::make_shared<Engine>(hosts[0], MakeSparseSumGraph(hosts), SparseSumOperators(results), *transport,
                                         pool);
  (void)(*self)->service.AddEngine(engine.get());
  const std::string host_line = absl::StrCat(hosts[0], " ", hosts[1], " ", hosts[2]);
  for (auto& p : peers) {
    ASSERT_TRUE(p.WriteLine(host_line).ok());
    ASSERT_TRUE(p.WaitForLine("ready", absl::Seconds(30)).ok());
  }
  for (auto& p : peers) ASSERT_TRUE(p.WriteLine("go").ok());
  auto expected = DriveSparseSum(*engine, kEpochs, kSeed);
  // Buckets 0 and 3 report here; the peers print the rest.
  ASSERT_TRUE(results.WaitFor(2 * kEpochs, absl::Seconds(30)));
  // Each peer hosts two buckets and one sink: three results per epoch, printed as it gets them.
  for (auto& p : peers) {
    for (int i = 0; i < 3 * kEpochs; ++i) {
      auto line = p.WaitForLine("result ", absl::Seconds(30));
      ASSERT_TRUE(line.ok()) << line.status();
      std::vector<std::string> parts = absl::StrSplit(*line, ' ');
      int64_t value = 0;
      ASSERT_TRUE(parts.size() == 3 && absl::SimpleAtoi(parts[2], &value)) << *line;
      results.Record(parts[1], value);
    }
  }
  CheckResults(results, expected);
  for (auto& p : peers) p.CloseStdin();  // the peers exit at end of input
  for (auto& p : peers) p.Stop(SIGTERM);
  transport.reset();
  self->reset();
  pool.Shutdown();
}

TEST(GraphDefTest, RejectsBadEdges) {
  GraphDef g("g");
  int a = *g.AddNode("a", {"h", "h"});
  int b = *g.AddNode("b", {"h", "h", "h"});
  EXPECT_FALSE(g.AddEdge(a, b, EdgeKind::kOneToOne).ok());  // shard counts differ
  EXPECT_FALSE(g.AddEdge(b, a, EdgeKind::kAllToAll).ok());  // backwards
  EXPECT_FALSE(g.AddEdge(a, 7, EdgeKind::kSparse).ok());
  EXPECT_FALSE(g.AddNode("empty", {}).ok());
  EXPECT_TRUE(g.AddEdge(a, b, EdgeKind::kSparse).ok());
  EXPECT_FALSE(g.AddEdge(a, b, EdgeKind::kAnnounced).ok());  // two producer shards
  int c = *g.AddNode("c", {"h"});
  EXPECT_FALSE(g.AddEdge(c, c, EdgeKind::kAnnounced).ok());
  int d = *g.AddNode("d", {"h", "h"});
  EXPECT_TRUE(g.AddEdge(c, d, EdgeKind::kAnnounced).ok());
  EXPECT_FALSE(g.AddEdge(a, d, EdgeKind::kSparse).ok());  // d sees only announced epochs
  int e = *g.AddNode("e", {"h", "h"});
  EXPECT_FALSE(g.AddEdge(d, e, EdgeKind::kAllToAll).ok());  // d's shards cannot punctuate every epoch
  EXPECT_TRUE(g.AddEdge(d, e, EdgeKind::kOneToOne).ok());
  int f = *g.AddNode("f", {"h", "h"});
  EXPECT_TRUE(g.AddEdge(a, f, EdgeKind::kOneToOne).ok());
  EXPECT_FALSE(g.AddEdge(e, f, EdgeKind::kOneToOne).ok());  // f already sees every epoch
}

// An announced edge: an epoch reaches only the consumer shards sent something in it, and what
// follows them (here one-to-one) finishes for those alone; the other hosts never hear of it.
TEST(EngineTest, AnAnnouncedEpochReachesOnlyTheShardsItSendsTo) {
  const std::vector<std::string> hosts = {"h0", "h1", "h2"};
  auto g = std::make_shared<GraphDef>("announced");
  const int src = *g->AddNode("src", {"h0"});
  const int mid = *g->AddNode("mid", hosts);
  const int done = *g->AddNode("done", {"h0", "h0", "h0"});
  ASSERT_TRUE(g->AddEdge(src, mid, EdgeKind::kAnnounced).ok());
  ASSERT_TRUE(g->AddEdge(mid, done, EdgeKind::kOneToOne).ok());
  absl::Mutex mu;
  std::set<std::tuple<int, int, int64_t>> finished;  // (node, shard, epoch)
  struct Op : Operator {
    Op(int node, absl::Mutex& mu, std::set<std::tuple<int, int, int64_t>>& finished)
        : node(node), mu(mu), finished(finished) {}
    void OnMessage(ShardContext& ctx, int, int, const std::string& payload) override {
      if (ctx.node() == 0) ctx.Send(0, std::stoi(payload), "op");
    }
    void OnEpochDone(ShardContext& ctx) override {
      absl::MutexLock lock(&mu);
      finished.insert({node, ctx.shard(), ctx.epoch()});
    }
    int node;
    absl::Mutex& mu;
    std::set<std::tuple<int, int, int64_t>>& finished;
  };
  LocalTransport transport;
  std::vector<std::unique_ptr<ThreadPool>> pools;
  std::vector<std::shared_ptr<Engine>> engines;
  for (const auto& h : hosts) {
    pools.push_back(std::make_unique<ThreadPool>(h, 1));
    engines.push_back(std::make_shared<Engine>(
        h, g, [&](int node, int) { return std::make_unique<Op>(node, mu, finished); }, transport, *pools.back()));
    transport.Register(engines.back().get());
  }
  ASSERT_TRUE(engines[0]->InjectAll(src, 0, 1, {"0", "2"}).ok());
  ASSERT_TRUE(engines[0]->InjectAll(src, 0, 2, {"1"}).ok());
  {
    absl::MutexLock lock(&mu);
    auto done_with = [&](int shard, int64_t epoch) { return finished.contains({done, shard, epoch}); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(+[](decltype(done_with)* f) {
                                      return (*f)(0, 1) && (*f)(2, 1) && (*f)(1, 2);
                                    }, &done_with),
                                    absl::Seconds(30)));
  }
  // Everything the epochs caused has arrived once `done` finished; the rest never will.
  for (auto& p : pools) p->Shutdown();
  const std::set<std::tuple<int, int, int64_t>> expected = {
      {src, 0, 1}, {src, 0, 2}, {mid, 0, 1}, {mid, 2, 1}, {mid, 1, 2}, {done, 0, 1}, {done, 2, 1}, {done, 1, 2}};
  absl::MutexLock lock(&mu);
  EXPECT_EQ(finished, expected);
  // h1 heard only of epoch 2 and h2 only of epoch 1: one batch each way for each.
  EXPECT_EQ(engines[1]->batches_sent(), 1);
  EXPECT_EQ(engines[2]->batches_sent(), 1);
}

TEST(EngineTest, InjectOnlyAtLocalSources) {
  auto g = std::make_shared<GraphDef>("g");
  int a = *g->AddNode("a", {"h"});
  int b = *g->AddNode("b", {"other"});
  ASSERT_TRUE(g->AddEdge(a, b, EdgeKind::kOneToOne).ok());
  LocalTransport transport;
  ThreadPool pool("h", 1);
  struct Nop : Operator {
    void OnMessage(ShardContext&, int, int, const std::string&) override {}
    void OnEpochDone(ShardContext&) override {}
  };
  auto engine = std::make_shared<Engine>("h", g, [](int, int) { return std::make_unique<Nop>(); }, transport, pool);
  EXPECT_EQ(engine->Inject(b, 0, 1, "x").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine->Inject(a, 3, 1, "x").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(engine->Inject(a, 0, 1, "x").ok());
  pool.Shutdown();
}

// An owner that goes shuts its engine down: work that arrives later (a batch still queued, which
// holds the engine) no longer reaches the operators, which are gone.
TEST(EngineTest, AfterShutdownOperatorsAreGoneAndInputIsDropped) {
  auto g = std::make_shared<GraphDef>("g");
  int a = *g->AddNode("a", {"h"});
  LocalTransport transport;
  ThreadPool pool("h", 1);
  struct Counting : Operator {
    Counting(std::atomic<int>& calls, std::atomic<bool>& destroyed) : calls(calls), destroyed(destroyed) {}
    ~Counting() override { destroyed = true; }
    void OnMessage(ShardContext&, int, int, const std::string&) override { ++calls; }
    void OnEpochDone(ShardContext&) override { ++calls; }
    std::atomic<int>& calls;
    std::atomic<bool>& destroyed;
  };
  std::atomic<int> calls{0};
  std::atomic<bool> destroyed{false};
  auto engine = std::make_shared<Engine>(
      "h", g, [&](int, int) { return std::make_unique<Counting>(calls, destroyed); }, transport, pool);
  ASSERT_TRUE(engine->InjectAll(a, 0, 1, {"x"}).ok());
  EXPECT_EQ(calls.load(), 2);  // the message and the epoch's end
  engine->Shutdown();
  EXPECT_TRUE(destroyed.load());
  EXPECT_EQ(engine->InjectAll(a, 0, 2, {"y"}).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls.load(), 2);
  pool.Shutdown();
}

}  // namespace
}  // namespace pathways::dataflow
