#include "dataflow/dataflow_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "core/logging.h"
#include "core/socket_util.h"
#include "core/tsan.h"
#include "dataflow/control_graph.h"
#include "dataflow/stream_peer.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways::dataflow {
namespace {

// The services of this process by the address they serve at. Delivery holds the reader lock, so a
// service leaving (the writer lock) waits for batches being handed to it.
absl::Mutex& in_process_mu = *new absl::Mutex;  // never destroyed, as the map it guards
std::map<std::string, DataflowService*>& InProcessServices() ABSL_SHARED_LOCKS_REQUIRED(in_process_mu) {
  static auto* services = new std::map<std::string, DataflowService*>();
  return *services;
}

}  // namespace

int64_t PayloadBytes(const std::vector<Envelope>& batch) {
  int64_t n = 0;
  for (const Envelope& e : batch) n += static_cast<int64_t>(e.payload.size());
  return n;
}

bool LostEpochs::Has(int64_t epoch) const {
  for (const auto& [first, last] : ranges) {
    if (epoch >= first && epoch <= last) return true;
  }
  return epochs.contains(epoch);
}

void LostEpochs::Add(int64_t epoch) {
  if (Has(epoch)) return;
  epochs.insert(epoch);
  if (epochs.size() <= kMaxListed) return;
  // Too many to list: one range from the smallest to the largest, this sender's only one.
  const auto [lo, hi] = std::minmax_element(epochs.begin(), epochs.end());
  if (ranges.empty()) {
    ranges.emplace_back(*lo, *hi);
  } else {
    ranges[0] = {std::min(ranges[0].first, *lo), std::max(ranges[0].second, *hi)};
  }
  epochs.clear();
}

void LostEpochs::Add(const std::vector<Envelope>& batch, const std::string& reason) {
  if (why.empty()) why = reason;
  for (const Envelope& e : batch) Add(e.epoch);
}

void LostEpochs::Merge(const LostEpochs& other) {
  if (why.empty()) why = other.why;
  epochs.insert(other.epochs.begin(), other.epochs.end());  // a merge lists them all
  ranges.insert(ranges.end(), other.ranges.begin(), other.ranges.end());
}

bool DataflowService::DeliverInProcess(const std::string& from, const std::string& host, const std::string& graph,
                                       std::vector<Envelope>& batch) {
  absl::ReaderMutexLock lock(&in_process_mu);
  auto& services = InProcessServices();
  auto it = services.find(host);
  if (it == services.end()) return false;
  it->second->Receive(from, graph, std::move(batch));
  return true;
}

DataflowService::~DataflowService() { StopServingInProcess(); }

void DataflowService::StopServingInProcess() {
  absl::MutexLock lock(&in_process_mu);
  if (in_process_address_.empty()) return;
  auto& services = InProcessServices();
  if (auto it = services.find(in_process_address_); it != services.end() && it->second == this) services.erase(it);
  in_process_address_.clear();
}

void DataflowService::ServeInProcess(const std::string& address) {
  absl::MutexLock lock(&in_process_mu);
  in_process_address_ = address;
  InProcessServices()[address] = this;
}

LostEpochs DataflowService::AddEngine(Engine* engine) {
  const std::string& graph = engine->graph().name();
  std::vector<HeldBatch> held;
  LostEpochs lost;
  {
    absl::MutexLock lock(&mu_);
    engines_[graph] = engine;
    removed_.erase(graph);  // a graph may come back (a program registered again)
    auto it = held_.find(graph);
    if (it != held_.end()) {
      ReleaseLocked(it->second);
      held = std::move(it->second.batches);
      held_.erase(it);
    }
    if (auto l = lost_.find(graph); l != lost_.end()) {
      absl::flat_hash_set<std::string> hosts;
      for (const NodeDef& node : engine->graph().nodes()) hosts.insert(node.shard_hosts.begin(), node.shard_hosts.end());
      for (const auto& [from, epochs] : l->second.senders) {
        if (hosts.contains(from)) lost.Merge(epochs);
      }
      if (!l->second.others.empty()) lost.Merge(l->second.others);
      lost_.erase(l);
      lost_order_.erase(std::find(lost_order_.begin(), lost_order_.end(), graph));
    }
  }
  for (auto& batch : held) engine->Deliver(std::move(batch.envelopes));
  return lost;
}

DataflowService::Pool& DataflowService::PoolOf(const std::string& graph) {
  return absl::StartsWith(graph, kControlGraphPrefix) ? control_ : programs_;
}

void DataflowService::ReleaseLocked(const Held& held) {
  Pool& pool = *held.pool;
  pool.batches -= held.batches.size();
  pool.bytes -= held.bytes;
  for (const HeldBatch& b : held.batches) {
    auto it = pool.by_peer.find(b.from);
    if (it == pool.by_peer.end()) continue;
    it->second -= b.bytes;
    if (it->second == 0) pool.by_peer.erase(it);
  }
}

void DataflowService::LoseLocked(const std::string& graph, const std::string& from,
                                 const std::vector<Envelope>& batch, const std::string& why) {
  auto [it, fresh] = lost_.try_emplace(graph);
  std::map<std::string, LostEpochs>& senders = it->second.senders;
  const bool listed = senders.contains(from) || senders.size() < kMaxLostSenders;
  (listed ? senders[from] : it->second.others).Add(batch, why);
  if (!fresh) return;
  lost_order_.push_back(graph);
  if (lost_order_.size() > kRememberedLost) {
    lost_.erase(lost_order_.front());
    lost_order_.pop_front();
  }
}

void DataflowService::DropStaleLocked(absl::Time now) {
  // Once a second at most: a flood past the bounds must not cost a scan of everything held per
  // batch (nothing becomes stale much faster than that).
  if (now < next_stale_scan_) return;
  next_stale_scan_ = now + absl::Seconds(1);
  const std::string why = absl::StrCat("its batches were held ", absl::FormatDuration(kHoldFor),
                                       " for it to be set up on this host, then dropped");
  size_t graphs = 0, batches = 0;
  for (auto it = held_.begin(); it != held_.end();) {
    if (now - it->second.since < kHoldFor) {
      ++it;
      continue;
    }
    ReleaseLocked(it->second);
    for (const HeldBatch& b : it->second.batches) LoseLocked(it->first, b.from, b.envelopes, why);
    ++graphs;
    batches += it->second.batches.size();
    it = held_.erase(it);
  }
  if (graphs == 0) return;
  dropped_.fetch_add(static_cast<int64_t>(batches), std::memory_order_relaxed);
  PW_LOG(Warning) << "dataflow: " << graphs << " graphs never came in " << absl::FormatDuration(kHoldFor) << "; their "
                  << batches << " held batches dropped";
}

bool DataflowService::CountDrop() {
  const int64_t n = dropped_.fetch_add(1, std::memory_order_relaxed) + 1;
  return (n & (n - 1)) == 0;  // the 1st, 2nd, 4th, ...: a flood does not flood the log
}

size_t DataflowService::num_held_bytes() {
  absl::MutexLock lock(&mu_);
  return programs_.bytes + control_.bytes;
}

size_t DataflowService::num_held_batches() {
  absl::MutexLock lock(&mu_);
  return programs_.batches + control_.batches;
}

void DataflowService::RemoveEngine(const std::string& graph) {
  absl::MutexLock lock(&mu_);
  if (engines_.erase(graph) == 0 || !removed_.insert(graph).second) return;
  removed_order_.push_back(graph);
  if (removed_order_.size() > kRememberedRemoved) {
    removed_.erase(removed_order_.front());
    removed_order_.pop_front();
  }
}

// Reads one peer's stream: each batch is handed over as it comes.
class DataflowService::Reader : public grpc::ServerReadReactor<rpc::DataflowBatch> {
 public:
  Reader(DataflowService& service, grpc::CallbackServerContext* context) : service_(service) {
    if (absl::Status s = CheckCallToken(*context, service_.token_); !s.ok()) {
      Finish(ToGrpc(s));
      return;
    }
    StartRead(&batch_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the peer finished its writes, or the stream broke
      Finish(grpc::Status::OK);
      return;
    }
    std::vector<Envelope> envelopes;
    envelopes.reserve(batch_.envelopes_size());
    for (auto& e : *batch_.mutable_envelopes()) envelopes.push_back(EnvelopeFromProto(e));
    service_.Receive(batch_.src_host(), batch_.graph(), std::move(envelopes));
    StartRead(&batch_);
  }
  void OnDone() override { delete this; }

 private:
  DataflowService& service_;
  rpc::DataflowBatch batch_;
};

grpc::ServerReadReactor<rpc::DataflowBatch>* DataflowService::Stream(grpc::CallbackServerContext* context,
                                                                     rpc::DataflowAck*) {
  return new Reader(*this, context);
}

grpc::ServerUnaryReactor* DataflowService::StreamPort(grpc::CallbackServerContext* context,
                                                      const rpc::StreamPortRequest*,
                                                      rpc::StreamPortResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const absl::Status s =
      port_tenants_.has_value() ? CheckCallToken(*context, *port_tenants_, token_) : CheckCallToken(*context, token_);
  if (!s.ok()) {
    reactor->Finish(ToGrpc(s));
    return reactor;
  }
  response->set_port(stream_port_.load());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

StreamListener::Protocol DataflowService::StreamProtocol() {
  return DataflowStreamProtocol(
      token_,
      [this](const std::string& from, const std::string& graph, std::vector<Envelope> batch) {
        streamed_.fetch_add(1, std::memory_order_relaxed);
        Receive(from, graph, std::move(batch), /*on_reader=*/true);
      },
      kMaxStreamSenders);
}

void DataflowService::Receive(const std::string& sender, const std::string& graph, std::vector<Envelope> batch,
                              bool on_reader) {
  bytes_received_.fetch_add(PayloadBytes(batch), std::memory_order_relaxed);
  if (batch.empty()) return;  // nothing to hand over
  const std::string from = sender.substr(0, kMaxNameBytes);
  std::shared_ptr<Engine> here;  // handled on this thread, once the lock is released
  {
    absl::MutexLock lock(&mu_);
    auto it = engines_.find(graph);
    if (it != engines_.end() && on_reader && it->second->handles_on_arrival()) {
      here = it->second->shared_from_this();  // held: the engine cannot leave meanwhile
    } else if (it != engines_.end()) {
      // Under the lock: the engine cannot leave before its queued work holds it (Engine::Deliver).
      it->second->Deliver(std::move(batch));
      return;
    }
  }
  if (here != nullptr) {
    here->Handle(batch);
    return;
  }
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(graph);
  if (it != engines_.end()) {  // added meanwhile
    it->second->Deliver(std::move(batch));
    return;
  }
  if (removed_.contains(graph)) return;  // a straggler of a graph that is done here
  if (graph.size() > kMaxNameBytes) {
    if (CountDrop()) {
      PW_LOG(Error) << "dataflow: a batch from " << from << " names a graph of " << graph.size()
                    << " bytes (at most " << kMaxNameBytes << "); dropped (" << batches_dropped() << " so far)";
    }
    return;
  }
  // What holding it costs: its envelopes and payloads, and the batch itself (a flood of empty
  // envelopes is not free).
  size_t bytes = kHeldBatchOverhead + graph.size() + from.size();
  for (const Envelope& e : batch) bytes += sizeof(Envelope) + e.payload.size();
  const absl::Time now = absl::Now();
  Pool& pool = PoolOf(graph);
  auto it_held = held_.find(graph);
  // Which bound the batch would pass, if any.
  auto over = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> std::string {
    if (pool.batches >= kMaxHeldBatches) {
      return absl::StrCat(pool.batches, " batches held in all (at most ", kMaxHeldBatches, ")");
    }
    if (pool.bytes + bytes > pool.max_bytes) {
      return absl::StrCat(pool.bytes, " bytes held in all (at most ", pool.max_bytes, ")");
    }
    if (const size_t held = it_held == held_.end() ? 0 : it_held->second.bytes; held + bytes > max_held_bytes_per_graph_) {
      return absl::StrCat(held, " bytes held for the graph (at most ", max_held_bytes_per_graph_, ")");
    }
    auto peer = pool.by_peer.find(from);
    if (const size_t held = peer == pool.by_peer.end() ? 0 : peer->second; held + bytes > max_held_bytes_per_peer_) {
      return absl::StrCat(held, " bytes held from this sender (at most ", max_held_bytes_per_peer_, ")");
    }
    return "";
  };
  std::string why = over();
  if (!why.empty()) {
    DropStaleLocked(now);  // what was held too long goes first
    it_held = held_.find(graph);
    why = over();
  }
  if (!why.empty()) {
    why = absl::StrCat("a batch of ", bytes, " bytes from ", from,
                       " came before the graph was set up on this host and was dropped: ", why);
    LoseLocked(graph, from, batch, why);
    if (CountDrop()) PW_LOG(Error) << "dataflow: graph '" << graph << "': " << why << " (" << batches_dropped() << " so far)";
    return;
  }
  if (it_held == held_.end()) it_held = held_.emplace(graph, Held{&pool, {}, 0, now}).first;
  Held& held = it_held->second;
  pool.by_peer[from] += bytes;
  held.batches.push_back({from, std::move(batch), bytes});
  held.bytes += bytes;
  pool.bytes += bytes;
  ++pool.batches;
}

}  // namespace pathways::dataflow
