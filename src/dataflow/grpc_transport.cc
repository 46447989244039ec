#include "dataflow/grpc_transport.h"

#include "transport/auth.h"
#include "transport/rpc_util.h"

#include <map>
#include <thread>

#include "absl/synchronization/notification.h"

#include "core/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace pathways::dataflow {
namespace {

void ToProto(const Envelope& e, rpc::DataflowEnvelope* p) {
  p->set_epoch(e.epoch);
  p->set_edge(e.edge);
  p->set_src_shard(e.src_shard);
  p->set_dst_shard(e.dst_shard);
  p->set_punctuation(e.punctuation);
  p->set_count(e.count);
  p->set_payload(e.payload);
}

Envelope FromProto(const rpc::DataflowEnvelope& p) {
  return {p.epoch(), p.edge(), p.src_shard(), p.dst_shard(), p.punctuation(), p.count(), p.payload()};
}

// The services of this process by the address they serve at. Delivery holds the reader lock, so a
// service leaving (the writer lock) waits for batches being handed to it.
absl::Mutex in_process_mu;
std::map<std::string, DataflowService*>& InProcessServices() ABSL_EXCLUSIVE_LOCKS_REQUIRED(in_process_mu) {
  static auto* services = new std::map<std::string, DataflowService*>();
  return *services;
}

}  // namespace

// One long-lived client stream to one peer, written by its own thread. A stream that breaks is
// opened again and the message whose write failed is written again, a bounded number of times.
class GrpcTransport::PeerStream {
 public:
  PeerStream(const std::string& self, const std::string& peer)
      : self_(self), peer_(peer), stub_(rpc::Dataflow::NewStub(grpc::CreateChannel(peer, ChannelCredentials()))) {
    thread_ = std::thread([this] { Run(); });
  }
  // Queued messages get until `deadline` to go out; then the stream is cut: a peer that went
  // away must not hold up shutdown.
  void BeginClose(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    close_deadline_ = std::min(close_deadline_, deadline);
  }
  ~PeerStream() {
    BeginClose(absl::Now() + absl::Seconds(2));
    absl::Time deadline;
    {
      absl::MutexLock lock(&mu_);
      deadline = close_deadline_;
    }
    if (!done_.WaitForNotificationWithDeadline(deadline)) {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;  // a stream opened from now on is cancelled at once
      if (context_ != nullptr) context_->TryCancel();
    }
    thread_.join();
  }
  void Enqueue(const std::string& graph, std::vector<Envelope> batch) {
    absl::MutexLock lock(&mu_);
    pending_.push_back({graph, std::move(batch)});
  }
  int64_t written() {
    absl::MutexLock lock(&mu_);
    return written_;
  }

 private:
  struct Stream {
    std::unique_ptr<grpc::ClientContext> context;
    rpc::DataflowAck ack;
    std::unique_ptr<grpc::ClientWriter<rpc::DataflowBatch>> writer;
  };

  std::unique_ptr<Stream> Open() {
    auto stream = std::make_unique<Stream>();
    stream->context = std::make_unique<grpc::ClientContext>();
    stream->context->set_wait_for_ready(true);  // a peer still starting is waited for
    AttachCallToken(*stream->context);
    {
      absl::MutexLock lock(&mu_);
      context_ = stream->context.get();
      // Cancelled before the call starts, the call ends as it starts instead of waiting for a
      // peer that is gone.
      if (cancelled_) context_->TryCancel();
    }
    stream->writer = stub_->Stream(stream->context.get(), &stream->ack);
    return stream;
  }

  void Close(std::unique_ptr<Stream> stream, bool broken) {
    if (!broken) stream->writer->WritesDone();
    grpc::Status status = stream->writer->Finish();
    {
      absl::MutexLock lock(&mu_);
      context_ = nullptr;
    }
    if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
      PW_LOG(Info) << "dataflow stream to " << peer_ << " ended: " << status.error_message();
    }
  }

  void Run() {
    constexpr int kAttempts = 3;
    std::unique_ptr<Stream> stream = Open();
    while (true) {
      // Everything queued since the last write goes out together: one message per graph.
      std::map<std::string, rpc::DataflowBatch> messages;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](PeerStream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->closing_ || !s->pending_.empty(); },
            this));
        if (pending_.empty()) break;  // closing, and everything was sent
        for (const auto& [graph, batch] : pending_) {
          rpc::DataflowBatch& m = messages[graph];
          m.set_graph(graph);
          m.set_src_host(self_);
          for (const Envelope& e : batch) ToProto(e, m.add_envelopes());
        }
        pending_.clear();
        written_ += static_cast<int64_t>(messages.size());
      }
      for (const auto& [graph, message] : messages) {
        int attempt = 0;
        while (!stream->writer->Write(message)) {
          Close(std::move(stream), /*broken=*/true);
          bool closing;
          {
            absl::MutexLock lock(&mu_);
            closing = closing_;
          }
          if (closing || ++attempt == kAttempts) {
            PW_LOG(Error) << "dataflow: " << message.envelopes_size() << " envelopes for " << peer_
                          << " dropped after " << attempt << " broken streams";
            stream = Open();
            break;
          }
          stream = Open();
        }
      }
    }
    Close(std::move(stream), /*broken=*/false);
    done_.Notify();
  }

  const std::string self_;
  const std::string peer_;
  std::unique_ptr<rpc::Dataflow::Stub> stub_;
  absl::Mutex mu_;
  std::vector<std::pair<std::string, std::vector<Envelope>>> pending_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time close_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // of the open stream, to cancel it
  absl::Notification done_;
  std::thread thread_;
};

GrpcTransport::GrpcTransport(std::string self_host) : self_host_(std::move(self_host)) {}

GrpcTransport::~GrpcTransport() {
  absl::MutexLock lock(&mu_);
  // Every peer gets the same grace period, not one after another.
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  for (auto& [host, peer] : peers_) peer->BeginClose(deadline);
  peers_.clear();
}

void GrpcTransport::Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) {
  {
    absl::ReaderMutexLock lock(&in_process_mu);
    auto& services = InProcessServices();
    if (auto it = services.find(host); it != services.end()) {
      it->second->Receive(graph, std::move(batch));
      in_process_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  auto& peer = peers_[host];
  if (!peer) peer = std::make_unique<PeerStream>(self_host_, host);
  peer->Enqueue(graph, std::move(batch));
}

int64_t GrpcTransport::messages_written() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [host, peer] : peers_) n += peer->written();
  return n;
}

int64_t GrpcTransport::batches_in_process() const { return in_process_.load(std::memory_order_relaxed); }

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
      held = std::move(it->second);
      num_held_ -= held.size();
      held_.erase(it);
    }
  }
  for (auto& batch : held) engine->Deliver(std::move(batch));
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

grpc::Status DataflowService::Stream(grpc::ServerContext* context, grpc::ServerReader<rpc::DataflowBatch>* reader,
                                     rpc::DataflowAck*) {
  if (absl::Status s = CheckCallToken(*context, token_); !s.ok()) return ToGrpc(s);
  rpc::DataflowBatch batch;
  while (reader->Read(&batch)) {
    std::vector<Envelope> envelopes;
    envelopes.reserve(batch.envelopes_size());
    for (const auto& e : batch.envelopes()) envelopes.push_back(FromProto(e));
    Receive(batch.graph(), std::move(envelopes));
  }
  return grpc::Status::OK;
}

void DataflowService::Receive(const std::string& graph, std::vector<Envelope> batch) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(graph);
  if (it != engines_.end()) {
    // Under the lock: the engine cannot leave before its queued work holds it (Engine::Deliver).
    it->second->Deliver(std::move(batch));
    return;
  }
  if (removed_.contains(graph)) return;  // a straggler of a graph that is done here
  if (num_held_ >= kMaxHeldBatches) {
    PW_LOG(Error) << "dataflow: graph '" << graph << "' unknown here and " << num_held_
                  << " batches already held; batch dropped";
    return;
  }
  held_[graph].push_back(std::move(batch));
  ++num_held_;
}

}  // namespace pathways::dataflow
