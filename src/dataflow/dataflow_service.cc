#include "dataflow/dataflow_service.h"

#include <utility>

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

bool DataflowService::DeliverInProcess(const std::string& host, const std::string& graph,
                                       std::vector<Envelope>& batch) {
  absl::ReaderMutexLock lock(&in_process_mu);
  auto& services = InProcessServices();
  auto it = services.find(host);
  if (it == services.end()) return false;
  it->second->Receive(graph, std::move(batch));
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

void DataflowService::AddEngine(Engine* engine) {
  std::vector<std::vector<Envelope>> held;
  {
    absl::MutexLock lock(&mu_);
    engines_[engine->graph().name()] = engine;
    removed_.erase(engine->graph().name());  // a graph may come back (a program registered again)
    auto it = held_.find(engine->graph().name());
    if (it != held_.end()) {
      held = std::move(it->second.batches);
      num_held_ -= held.size();
      held_bytes_ -= it->second.bytes;
      held_.erase(it);
    }
  }
  for (auto& batch : held) engine->Deliver(std::move(batch));
}

void DataflowService::DropStaleLocked(absl::Time now) {
  for (auto it = held_.begin(); it != held_.end();) {
    if (now - it->second.since < kHoldFor) {
      ++it;
      continue;
    }
    PW_LOG(Warning) << "dataflow: graph '" << it->first << "' never came in " << absl::FormatDuration(kHoldFor)
                    << "; its " << it->second.batches.size() << " held batches dropped";
    num_held_ -= it->second.batches.size();
    held_bytes_ -= it->second.bytes;
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
    service_.Receive(batch_.graph(), std::move(envelopes));
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
            ServeDataflowStream(fd, listener, [this](const std::string& graph, std::vector<Envelope> batch) {
              streamed_.fetch_add(1, std::memory_order_relaxed);
              Receive(graph, std::move(batch));
            });
          },
          kMaxStreamSenders};
}

void DataflowService::Receive(const std::string& graph, std::vector<Envelope> batch) {
  bytes_received_.fetch_add(PayloadBytes(batch), std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(graph);
  if (it != engines_.end()) {
    // Under the lock: the engine cannot leave before its queued work holds it (Engine::Deliver).
    it->second->Deliver(std::move(batch));
    return;
  }
  if (removed_.contains(graph)) return;  // a straggler of a graph that is done here
  size_t bytes = 0;
  for (const Envelope& e : batch) bytes += sizeof(Envelope) + e.payload.size();
  const absl::Time now = absl::Now();
  if (num_held_ >= kMaxHeldBatches || held_bytes_ + bytes > max_held_bytes_) DropStaleLocked(now);
  auto [slot, fresh] = held_.try_emplace(graph);
  Held& held = slot->second;
  if (fresh) held.since = now;
  if (num_held_ >= kMaxHeldBatches || held_bytes_ + bytes > max_held_bytes_ ||
      held.bytes + bytes > max_held_bytes_per_graph_) {
    PW_LOG(Error) << "dataflow: graph '" << graph << "' unknown here; a batch of " << bytes
                  << " bytes dropped: " << num_held_ << " batches of " << held_bytes_ << " bytes held in all ("
                  << held.bytes << " for this graph; limits " << kMaxHeldBatches << " batches, " << max_held_bytes_
                  << " bytes, " << max_held_bytes_per_graph_ << " bytes per graph)";
    if (held.batches.empty()) held_.erase(graph);
    return;
  }
  held.batches.push_back(std::move(batch));
  held.bytes += bytes;
  held_bytes_ += bytes;
  ++num_held_;
}

}  // namespace pathways::dataflow
