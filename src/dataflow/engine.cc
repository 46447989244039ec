#include "dataflow/engine.h"

#include "absl/strings/str_cat.h"
#include "core/logging.h"

namespace pathways::dataflow {
namespace {
int64_t ShardKey(int node, int shard) { return (static_cast<int64_t>(node) << 32) | static_cast<uint32_t>(shard); }
}  // namespace

void ShardContext::Send(int edge, int dst_shard, std::string payload) {
  const GraphDef& g = engine_.graph();
  if (edge < 0 || edge >= static_cast<int>(g.edges().size()) || g.edges()[edge].from != node_) {
    PW_LOG(Error) << "dataflow: node " << node_ << " sent on edge " << edge << ", which does not leave it";
    return;
  }
  const EdgeDef& e = g.edges()[edge];
  if (dst_shard < 0 || dst_shard >= g.num_shards(e.to) || (e.kind == EdgeKind::kOneToOne && dst_shard != shard_)) {
    PW_LOG(Error) << "dataflow: shard " << shard_ << " of node " << node_ << " cannot send to shard " << dst_shard
                  << " over edge " << edge;
    return;
  }
  ++(*sent_)[{edge, dst_shard}];
  engine_.Emit(node_, shard_, epoch_, edge, dst_shard, /*punctuation=*/false, 0, std::move(payload));
}

Engine::Engine(std::string host, std::shared_ptr<const GraphDef> graph, OperatorFactory factory,
               Transport& transport, Executor& executor)
    : host_(std::move(host)), graph_(std::move(graph)), transport_(transport), executor_(executor) {
  for (int n = 0; n < static_cast<int>(graph_->nodes().size()); ++n) {
    for (int s = 0; s < graph_->num_shards(n); ++s) {
      if (graph_->nodes()[n].shard_hosts[s] != host_) continue;
      shards_[ShardKey(n, s)] = std::make_unique<Shard>(n, s, factory(n, s));
    }
  }
}

Engine::Shard* Engine::FindShard(int node, int shard) {
  auto it = shards_.find(ShardKey(node, shard));
  return it == shards_.end() ? nullptr : it->second.get();
}

Engine::EpochState& Engine::EpochOf(Shard& s, int64_t epoch) {
  auto [it, inserted] = s.epochs.try_emplace(epoch);
  if (inserted) {
    const size_t n = graph_->in_edges(s.node).size();
    it->second.punctuations.assign(n, 0);
    it->second.promised.assign(n, 0);
    it->second.received.assign(n, 0);
  }
  return it->second;
}

absl::Status Engine::Inject(int node, int shard, int64_t epoch, std::string payload) {
  std::vector<std::string> one;
  one.push_back(std::move(payload));
  return Feed(node, shard, epoch, std::move(one), /*close=*/false);
}

absl::Status Engine::CloseInput(int node, int shard, int64_t epoch) { return Feed(node, shard, epoch, {}, true); }

absl::Status Engine::InjectAll(int node, int shard, int64_t epoch, std::vector<std::string> payloads) {
  return Feed(node, shard, epoch, std::move(payloads), /*close=*/true);
}

absl::Status Engine::Feed(int node, int shard, int64_t epoch, std::vector<std::string> payloads, bool close) {
  if (stopped_.load()) return absl::CancelledError(absl::StrCat("dataflow ", graph_->name(), " was shut down"));
  Shard* s = FindShard(node, shard);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("shard ", shard, " of node ", node, " is not on ", host_));
  if (!graph_->in_edges(node).empty()) return absl::InvalidArgumentError("input can only be fed to sources");
  {
    absl::MutexLock lock(&s->mu);
    if (s->finished.contains(epoch)) {
      if (payloads.empty()) return absl::OkStatus();  // closing again is harmless
      return absl::FailedPreconditionError(absl::StrCat("epoch ", epoch, " is closed"));
    }
    EpochState& st = EpochOf(*s, epoch);
    ShardContext ctx(*this, node, shard, epoch, &st.sent);
    for (const std::string& payload : payloads) s->op->OnMessage(ctx, -1, -1, payload);
    if (close) {
      st.input_closed = true;
      MaybeFinish(*s, epoch);
    }
  }
  Flush();
  return absl::OkStatus();
}

namespace {

// What a shut-down engine's shards run instead of their operators.
class Dropped : public Operator {
 public:
  void OnMessage(ShardContext&, int, int, const std::string&) override {}
  void OnEpochDone(ShardContext&) override {}
};

}  // namespace

void Engine::Shutdown() {
  stopped_.store(true);
  for (auto& [key, shard] : shards_) {
    absl::MutexLock lock(&shard->mu);  // waits for a callback in progress
    shard->op = std::make_unique<Dropped>();
  }
}

void OwnedEngines::Add(const std::shared_ptr<Engine>& engine) {
  absl::MutexLock lock(&mu_);
  std::erase_if(engines_, [](const std::weak_ptr<Engine>& e) { return e.expired(); });
  engines_.push_back(engine);
}

void OwnedEngines::ShutdownAll() {
  std::vector<std::shared_ptr<Engine>> alive;
  {
    absl::MutexLock lock(&mu_);
    for (const std::weak_ptr<Engine>& e : engines_) {
      if (auto engine = e.lock()) alive.push_back(std::move(engine));
    }
    engines_.clear();
  }
  for (auto& engine : alive) engine->Shutdown();
}

void Engine::Deliver(std::vector<Envelope> batch) {
  executor_.Schedule([self = shared_from_this(), batch = std::move(batch)]() { self->Handle(batch); });
}

void Engine::Handle(const std::vector<Envelope>& batch) {
  if (stopped_.load()) return;
  for (const Envelope& e : batch) Handle(e);
  Flush();  // everything produced while handling one batch leaves together
}

void Engine::Handle(const Envelope& e) {
  if (e.edge < 0 || e.edge >= static_cast<int>(graph_->edges().size())) {
    PW_LOG(Error) << "dataflow " << graph_->name() << ": envelope on unknown edge " << e.edge;
    return;
  }
  const int node = graph_->edges()[e.edge].to;
  Shard* s = FindShard(node, e.dst_shard);
  if (s == nullptr) {
    PW_LOG(Error) << "dataflow " << graph_->name() << ": shard " << e.dst_shard << " of node " << node << " is not on "
                  << host_;
    return;
  }
  const auto& in = graph_->in_edges(node);
  const size_t idx = std::find(in.begin(), in.end(), e.edge) - in.begin();
  absl::MutexLock lock(&s->mu);
  if (s->finished.contains(e.epoch)) {
    PW_LOG(Error) << "dataflow " << graph_->name() << ": message for finished epoch " << e.epoch;
    return;
  }
  EpochState& st = EpochOf(*s, e.epoch);
  if (e.punctuation) {
    ++st.punctuations[idx];
    st.promised[idx] += e.count;
  } else {
    ++st.received[idx];
    ShardContext ctx(*this, node, e.dst_shard, e.epoch, &st.sent);
    s->op->OnMessage(ctx, e.edge, e.src_shard, e.payload);
  }
  MaybeFinish(*s, e.epoch);
}

void Engine::MaybeFinish(Shard& s, int64_t epoch) {
  EpochState& st = s.epochs.at(epoch);
  const auto& in = graph_->in_edges(s.node);
  if (in.empty()) {
    if (!st.input_closed) return;
  } else {
    for (size_t i = 0; i < in.size(); ++i) {
      if (st.punctuations[i] < graph_->producers_per_consumer(in[i]) || st.received[i] < st.promised[i]) return;
    }
  }
  ShardContext ctx(*this, s.node, s.shard, epoch, &st.sent);
  s.op->OnEpochDone(ctx);
  for (int edge : graph_->out_edges(s.node)) {
    const EdgeDef& e = graph_->edges()[edge];
    auto punctuate = [&](int dst) {
      auto it = st.sent.find({edge, dst});
      Emit(s.node, s.shard, epoch, edge, dst, /*punctuation=*/true, it == st.sent.end() ? 0 : it->second, "");
    };
    if (e.kind == EdgeKind::kOneToOne) {
      punctuate(s.shard);
    } else if (e.kind == EdgeKind::kAnnounced) {
      for (const auto& [to, count] : st.sent) {
        if (to.first == edge && count > 0) punctuate(to.second);
      }
    } else {
      for (int dst = 0; dst < graph_->num_shards(e.to); ++dst) punctuate(dst);
    }
  }
  s.epochs.erase(epoch);
  s.finished.insert(epoch);
  s.finished_order.push_back(epoch);
  if (s.finished_order.size() > kRememberedEpochs) {
    s.finished.erase(s.finished_order.front());
    s.finished_order.pop_front();
  }
}

void Engine::Emit(int from_node, int src_shard, int64_t epoch, int edge, int dst_shard, bool punctuation,
                  int64_t count, std::string payload) {
  (void)from_node;
  const std::string& host = graph_->nodes()[graph_->edges()[edge].to].shard_hosts[dst_shard];
  absl::MutexLock lock(&out_mu_);
  outbox_[host].push_back({epoch, edge, src_shard, dst_shard, punctuation, count, std::move(payload)});
}

void Engine::Flush() {
  std::map<std::string, std::vector<Envelope>> out;
  {
    absl::MutexLock lock(&out_mu_);
    out.swap(outbox_);
    if (stopped_.load()) return;  // what a shut-down engine produced goes nowhere
    for (const auto& [host, batch] : out) {
      if (host == host_) continue;
      envelopes_sent_ += static_cast<int64_t>(batch.size());
      ++batches_sent_;
    }
  }
  for (auto& [host, batch] : out) {
    if (host == host_) {
      Deliver(std::move(batch));  // stays in memory: no transport, no serialisation
    } else {
      transport_.Send(host, graph_->name(), std::move(batch));
    }
  }
}

int64_t Engine::envelopes_sent() const {
  absl::MutexLock lock(&out_mu_);
  return envelopes_sent_;
}

int64_t Engine::batches_sent() const {
  absl::MutexLock lock(&out_mu_);
  return batches_sent_;
}

void LocalTransport::Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) {
  auto it = engines_.find({host, graph});
  if (it == engines_.end()) {
    PW_LOG(Error) << "dataflow: no engine for graph " << graph << " on host " << host;
    return;
  }
  it->second->Deliver(std::move(batch));
}

}  // namespace pathways::dataflow
