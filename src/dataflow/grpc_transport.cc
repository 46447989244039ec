#include "dataflow/grpc_transport.h"

#include <deque>
#include <thread>

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

}  // namespace

class GrpcTransport::PeerStream {
 public:
  PeerStream(const std::string& graph, const std::string& self, const std::string& peer) : peer_(peer) {
    header_.set_graph(graph);
    header_.set_src_host(self);
    thread_ = std::thread([this] { Run(); });
  }
  ~PeerStream() {
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
    }
    thread_.join();
  }
  void Enqueue(std::vector<Envelope> batch) {
    absl::MutexLock lock(&mu_);
    for (auto& e : batch) pending_.push_back(std::move(e));
  }
  int64_t written() {
    absl::MutexLock lock(&mu_);
    return written_;
  }

 private:
  void Run() {
    auto channel = grpc::CreateChannel(peer_, grpc::InsecureChannelCredentials());
    auto stub = rpc::Dataflow::NewStub(channel);
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    rpc::DataflowAck ack;
    std::unique_ptr<grpc::ClientWriter<rpc::DataflowBatch>> writer = stub->Stream(&context, &ack);
    bool broken = false;
    while (true) {
      rpc::DataflowBatch message = header_;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](PeerStream* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) { return s->closing_ || !s->pending_.empty(); },
            this));
        if (pending_.empty()) break;  // closing, and everything was sent
        // Everything queued since the last write goes in one message.
        for (const Envelope& e : pending_) ToProto(e, message.add_envelopes());
        pending_.clear();
        ++written_;
      }
      if (!broken && !writer->Write(message)) {
        PW_LOG(Warning) << "dataflow stream to " << peer_ << " broke; its messages are dropped";
        broken = true;  // failure handling (re-routing, failing runs) belongs to the runtime
      }
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    if (!status.ok() && !broken) PW_LOG(Warning) << "dataflow stream to " << peer_ << " ended: " << status.error_message();
  }

  const std::string peer_;
  rpc::DataflowBatch header_;
  absl::Mutex mu_;
  std::deque<Envelope> pending_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

GrpcTransport::GrpcTransport(std::string graph, std::string self_host)
    : graph_(std::move(graph)), self_host_(std::move(self_host)) {}

GrpcTransport::~GrpcTransport() {
  absl::MutexLock lock(&mu_);
  peers_.clear();
}

void GrpcTransport::Send(const std::string& host, std::vector<Envelope> batch) {
  absl::MutexLock lock(&mu_);
  auto& peer = peers_[host];
  if (!peer) peer = std::make_unique<PeerStream>(graph_, self_host_, host);
  peer->Enqueue(std::move(batch));
}

int64_t GrpcTransport::messages_written() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [host, peer] : peers_) n += peer->written();
  return n;
}

void DataflowService::AddEngine(Engine* engine) {
  absl::MutexLock lock(&mu_);
  engines_[engine->graph().name()] = engine;
}

grpc::Status DataflowService::Stream(grpc::ServerContext*, grpc::ServerReader<rpc::DataflowBatch>* reader,
                                     rpc::DataflowAck*) {
  rpc::DataflowBatch batch;
  while (reader->Read(&batch)) {
    Engine* engine = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto it = engines_.find(batch.graph());
      if (it != engines_.end()) engine = it->second;
    }
    if (engine == nullptr) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no dataflow graph named '" + batch.graph() + "' here");
    }
    std::vector<Envelope> envelopes;
    envelopes.reserve(batch.envelopes_size());
    for (const auto& e : batch.envelopes()) envelopes.push_back(FromProto(e));
    engine->Deliver(std::move(envelopes));
  }
  return grpc::Status::OK;
}

}  // namespace pathways::dataflow
