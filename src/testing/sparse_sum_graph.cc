#include "testing/sparse_sum_graph.h"

#include <algorithm>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pathways::dataflow {
namespace {

int64_t Parse(const std::string& s) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) PW_LOG(Error) << "sparse sum: bad payload '" << s << "'";
  return v;
}

struct Source : Operator {
  void OnMessage(ShardContext& ctx, int, int, const std::string& payload) override {
    ctx.Send(0, static_cast<int>(Parse(payload) % 3), payload);
  }
  void OnEpochDone(ShardContext&) override {}
};

struct Bucket : Operator {
  explicit Bucket(SparseSumResults& r) : results(r) {}
  void OnMessage(ShardContext& ctx, int, int, const std::string& payload) override {
    sums[ctx.epoch()] += Parse(payload);
    counts[ctx.epoch()] += 1;
  }
  void OnEpochDone(ShardContext& ctx) override {
    results.Record(absl::StrCat("bucket", ctx.shard(), "/e", ctx.epoch(), "/count"), counts[ctx.epoch()]);
    ctx.Send(1, ctx.shard() % 2, absl::StrCat(sums[ctx.epoch()]));
    sums.erase(ctx.epoch());
    counts.erase(ctx.epoch());
  }
  SparseSumResults& results;
  std::map<int64_t, int64_t> sums, counts;
};

struct Sink : Operator {
  explicit Sink(SparseSumResults& r) : results(r) {}
  void OnMessage(ShardContext& ctx, int, int, const std::string& payload) override {
    totals[ctx.epoch()] += Parse(payload);
  }
  void OnEpochDone(ShardContext& ctx) override {
    results.Record(absl::StrCat("sink", ctx.shard(), "/e", ctx.epoch()), totals[ctx.epoch()]);
    totals.erase(ctx.epoch());
  }
  SparseSumResults& results;
  std::map<int64_t, int64_t> totals;
};

}  // namespace

void SparseSumResults::Record(const std::string& key, int64_t value) {
  {
    absl::MutexLock lock(&mu_);
    values_[key] = value;
  }
  if (on_record_) on_record_(key, value);
}

bool SparseSumResults::WaitFor(size_t n, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.size() >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

int64_t SparseSumResults::Get(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  return it == values_.end() ? -1 : it->second;
}

size_t SparseSumResults::size() {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

std::shared_ptr<GraphDef> MakeSparseSumGraph(const std::vector<std::string>& hosts) {
  auto g = std::make_shared<GraphDef>("sparse_sum");
  int source = *g->AddNode("source", {hosts[0], hosts[1], hosts[2], hosts[0]});
  int bucket = *g->AddNode("bucket", {hosts[0], hosts[1], hosts[2], hosts[0], hosts[1], hosts[2]});
  int sink = *g->AddNode("sink", {hosts[1], hosts[2]});
  (void)g->AddEdge(source, bucket, EdgeKind::kSparse);  // edge 0
  (void)g->AddEdge(bucket, sink, EdgeKind::kAllToAll);  // edge 1
  return g;
}

OperatorFactory SparseSumOperators(SparseSumResults& results) {
  return [&results](int node, int) -> std::unique_ptr<Operator> {
    if (node == 0) return std::make_unique<Source>();
    if (node == 1) return std::make_unique<Bucket>(results);
    return std::make_unique<Sink>(results);
  };
}

std::map<int64_t, std::pair<int64_t, int64_t>> DriveSparseSum(Engine& engine, int epochs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::map<int64_t, std::array<int64_t, 3>> by_residue;
  std::vector<std::pair<int64_t, int>> closes;
  for (int64_t e = 1; e <= epochs; ++e) {
    by_residue[e] = {0, 0, 0};
    for (int s = 0; s < 4; ++s) closes.push_back({e, s});
  }
  const auto& source_hosts = engine.graph().nodes()[0].shard_hosts;
  for (int i = 0; i < 40 * epochs; ++i) {
    int64_t e = 1 + static_cast<int64_t>(rng() % epochs);
    int s = static_cast<int>(rng() % 4);
    // Even epochs only carry multiples of 3: buckets 1 and 2 then get nothing either.
    int64_t v = static_cast<int64_t>(rng() % 1000) * 3 + (e % 2 == 0 ? 0 : static_cast<int64_t>(rng() % 2));
    by_residue[e][v % 3] += v;
    if (source_hosts[s] == engine.host()) (void)engine.Inject(0, s, e, absl::StrCat(v));
  }
  std::shuffle(closes.begin(), closes.end(), rng);
  for (auto [e, s] : closes) {
    if (source_hosts[s] == engine.host()) (void)engine.CloseInput(0, s, e);
  }
  std::map<int64_t, std::pair<int64_t, int64_t>> expected;
  for (const auto& [e, r] : by_residue) expected[e] = {r[0] + r[2], r[1]};
  return expected;
}

LoopbackDataflowHost::~LoopbackDataflowHost() {
  streams.reset();
  if (server) server->Shutdown();
}

absl::StatusOr<std::unique_ptr<LoopbackDataflowHost>> StartLoopbackDataflowHost(bool streams) {
  auto host = std::make_unique<LoopbackDataflowHost>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&host->service);
  host->server = builder.BuildAndStart();
  if (host->server == nullptr || port == 0) return absl::UnavailableError("cannot listen on loopback");
  host->address = absl::StrCat("127.0.0.1:", port);
  if (streams) {
    auto listener = StreamListener::Start("dataflow streams", "127.0.0.1", 0, {host->service.StreamProtocol()});
    if (!listener.ok()) return listener.status();
    host->streams = *std::move(listener);
    host->service.SetStreamPort(host->streams->port());
  }
  return host;
}

}  // namespace pathways::dataflow
