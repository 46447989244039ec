#include "dataflow/dataflow_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

#include "core/logging.h"
#include "core/socket_util.h"
#include "core/tsan.h"
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

void LostEpochs::Add(int64_t epoch) {
  if (Has(epoch)) return;
  if (epochs.size() < kMaxListed) {
    epochs.insert(epoch);
    return;
  }
  // Too many to list: every epoch from the smallest to the largest lost one counts from now on.
  epochs.insert(epoch);
  for (int64_t e : epochs) {
    if (range_first > range_last) {
      range_first = range_last = e;
    } else {
      range_first = std::min(range_first, e);
      range_last = std::max(range_last, e);
    }
  }
  epochs.clear();
}

void LostEpochs::Add(const std::vector<Envelope>& batch, const std::string& reason) {
  if (why.empty()) why = reason;
  for (const Envelope& e : batch) Add(e.epoch);
}

void LostEpochs::Merge(const LostEpochs& other) {
  if (why.empty()) why = other.why;
  for (int64_t e : other.epochs) Add(e);
  if (other.range_first > other.range_last) return;
  if (range_first > range_last) {
    range_first = other.range_first;
    range_last = other.range_last;
  } else {
    range_first = std::min(range_first, other.range_first);
    range_last = std::max(range_last, other.range_last);
  }
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
      held = std::move(it->second.batches);
      num_held_ -= held.size();
      held_bytes_ -= it->second.bytes;
      held_.erase(it);
      for (const HeldBatch& b : held) ReleaseLocked(b);
    }
    if (auto l = lost_.find(graph); l != lost_.end()) {
      absl::flat_hash_set<std::string> hosts;
      for (const NodeDef& node : engine->graph().nodes()) hosts.insert(node.shard_hosts.begin(), node.shard_hosts.end());
      for (const auto& [from, epochs] : l->second) {
        if (hosts.contains(from)) lost.Merge(epochs);
      }
      lost_.erase(l);
      lost_order_.erase(std::find(lost_order_.begin(), lost_order_.end(), graph));
    }
  }
  for (auto& batch : held) engine->Deliver(std::move(batch.envelopes));
  return lost;
}

void DataflowService::ReleaseLocked(const HeldBatch& batch) {
  auto it = held_by_peer_.find(batch.from);
  if (it == held_by_peer_.end()) return;
  it->second -= std::min(it->second, batch.bytes);
  if (it->second == 0) held_by_peer_.erase(it);
}

void DataflowService::LoseLocked(const std::string& graph, const std::string& from,
                                 const std::vector<Envelope>& batch, const std::string& why) {
  auto [it, fresh] = lost_.try_emplace(graph);
  std::map<std::string, LostEpochs>& senders = it->second;
  if (senders.size() < kMaxLostSenders || senders.contains(from)) senders[from].Add(batch, why);
  if (!fresh) return;
  lost_order_.push_back(graph);
  if (lost_order_.size() > kRememberedLost) {
    lost_.erase(lost_order_.front());
    lost_order_.pop_front();
  }
}

void DataflowService::DropStaleLocked(absl::Time now) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (now - it->second.since < kHoldFor) {
      ++it;
      continue;
    }
    PW_LOG(Warning) << "dataflow: graph '" << it->first << "' never came in " << absl::FormatDuration(kHoldFor)
                    << "; its " << it->second.batches.size() << " held batches dropped";
    const std::string why = absl::StrCat("its batches were held ", absl::FormatDuration(kHoldFor),
                                         " for it to be set up on this host, then dropped");
    for (const HeldBatch& b : it->second.batches) {
      ReleaseLocked(b);
      LoseLocked(it->first, b.from, b.envelopes, why);
    }
    num_held_ -= it->second.batches.size();
    held_bytes_ -= it->second.bytes;
    dropped_.fetch_add(static_cast<int64_t>(it->second.batches.size()), std::memory_order_relaxed);
    it = held_.erase(it);
  }
}

size_t DataflowService::num_held_bytes() {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

size_t DataflowService::num_held_batches() {
  absl::MutexLock lock(&mu_);
  return num_held_;
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
  return {std::string(kDataflowStreamMagic, kStreamMagicBytes), token_, "",
          [this](int fd, const StreamListener& listener, const std::string&) {
            ServeDataflowStream(
                fd, listener, [this](const std::string& from, const std::string& graph, std::vector<Envelope> batch) {
                  streamed_.fetch_add(1, std::memory_order_relaxed);
                  Receive(from, graph, std::move(batch));
                });
          },
          kMaxStreamSenders};
}

void DataflowService::Receive(const std::string& sender, const std::string& graph, std::vector<Envelope> batch) {
  bytes_received_.fetch_add(PayloadBytes(batch), std::memory_order_relaxed);
  const std::string from = sender.substr(0, kMaxNameBytes);
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(graph);
  if (it != engines_.end()) {
    // Under the lock: the engine cannot leave before its queued work holds it (Engine::Deliver).
    it->second->Deliver(std::move(batch));
    return;
  }
  if (removed_.contains(graph)) return;  // a straggler of a graph that is done here
  if (graph.size() > kMaxNameBytes) {
    PW_LOG(Error) << "dataflow: a batch from " << from << " names a graph of " << graph.size()
                  << " bytes (at most " << kMaxNameBytes << "); dropped";
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  size_t bytes = 0;
  for (const Envelope& e : batch) bytes += sizeof(Envelope) + e.payload.size();
  const absl::Time now = absl::Now();
  const auto from_held = held_by_peer_.find(from);
  if (num_held_ >= kMaxHeldBatches || held_bytes_ + bytes > max_held_bytes_ ||
      (from_held != held_by_peer_.end() && from_held->second + bytes > max_held_bytes_per_peer_)) {
    DropStaleLocked(now);  // may release some of this peer's room too
  }
  auto [slot, fresh] = held_.try_emplace(graph);
  Held& held = slot->second;
  if (fresh) held.since = now;
  size_t& peer_bytes = held_by_peer_[from];
  std::string over;
  if (num_held_ >= kMaxHeldBatches) {
    over = absl::StrCat(num_held_, " batches held in all (at most ", kMaxHeldBatches, ")");
  } else if (held_bytes_ + bytes > max_held_bytes_) {
    over = absl::StrCat(held_bytes_, " bytes held in all (at most ", max_held_bytes_, ")");
  } else if (held.bytes + bytes > max_held_bytes_per_graph_) {
    over = absl::StrCat(held.bytes, " bytes held for the graph (at most ", max_held_bytes_per_graph_, ")");
  } else if (peer_bytes + bytes > max_held_bytes_per_peer_) {
    over = absl::StrCat(peer_bytes, " bytes held from ", from, " (at most ", max_held_bytes_per_peer_, ")");
  }
  if (!over.empty()) {
    const std::string why = absl::StrCat("a batch of ", bytes, " bytes from ", from,
                                         " came before the graph was set up on this host and was dropped: ", over);
    PW_LOG(Error) << "dataflow: graph '" << graph << "': " << why;
    LoseLocked(graph, from, batch, why);
    dropped_.fetch_add(1, std::memory_order_relaxed);
    if (held.batches.empty()) held_.erase(graph);
    if (peer_bytes == 0) held_by_peer_.erase(from);
    return;
  }
  peer_bytes += bytes;
  held.batches.push_back({from, std::move(batch), bytes});
  held.bytes += bytes;
  held_bytes_ += bytes;
  ++num_held_;
}

}  // namespace pathways::dataflow
