#include "dataflow/grpc_transport.h"

#include <deque>
#include <utility>

#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/tsan.h"
#include "dataflow/dataflow_service.h"
#include "dataflow/grpc_peer_stream.h"
#include "dataflow/stream_peer.h"
#include "grpcpp/create_channel.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways::dataflow {

// One peer, reached over plain TCP when it has a stream listener (asked once, by its
// StreamPort call), over a gRPC stream otherwise (TLS is on here or there: the TCP streams are
// not encrypted). Batches sent before the answer comes wait for it, in order.
class GrpcTransport::Peer {
 public:
  Peer(const std::string& self, const std::string& host) : self_(self), host_(host) {
    if (!PlainControlStreams()) {
      grpc_ = std::make_unique<GrpcPeerStream>(self_, host_);
      answered_ = true;
      return;
    }
    stub_ = rpc::Dataflow::NewStub(grpc::CreateChannel(host_, ChannelCredentials()));
    context_.set_wait_for_ready(true);  // a peer still starting is waited for, a while
    context_.set_deadline(absl::ToChronoTime(absl::Now() + kAskFor));
    AttachCallToken(context_);
    TsanRelease(this);  // gRPC's core hands the call to the thread that completes it
    Executor* completions = &RpcCompletions();  // made here the first time, not on gRPC's thread
    stub_->async()->StreamPort(&context_, &request_, &response_, [this, completions](grpc::Status s) {
      TsanAcquire(this);
      // Answering starts a stream peer (a thread, a connection): not on gRPC's thread.
      completions->Schedule([this, s = std::move(s)] { Answered(s); });
    });
  }
  ~Peer() {
    context_.TryCancel();
    std::unique_ptr<StreamPeer> stream;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&answered_));  // the answer's callback uses this object
      stream = std::move(stream_);
    }
    stream.reset();  // joins its thread: a Lost() in flight finds no stream and returns
  }
  void BeginClose(absl::Time deadline) {
    {
      absl::MutexLock lock(&mu_);
      close_deadline_ = std::min(close_deadline_, deadline);
      if (asking_ != nullptr) asking_->TryCancel();
      if (answered_) {
        if (stream_) stream_->BeginClose(deadline);
        if (grpc_) grpc_->BeginClose(deadline);
        return;
      }
    }
    context_.TryCancel();  // closing: the batches waiting go out over gRPC, or are dropped there
  }
  // False, taking nothing, when more than `max_bytes` would wait for the peer (one batch alone
  // always goes): from then on the peer counts as refused, for good (what it should have had is
  // lost; the cluster makes it or this host leave).
  bool Enqueue(const std::string& graph, std::vector<Envelope> batch, int64_t max_bytes) {
    absl::MutexLock lock(&mu_);
    const int64_t bytes = HeldBytes(batch);
    int64_t queued = early_bytes_;
    if (stream_) queued += stream_->queued_bytes();
    if (grpc_) queued += grpc_->queued_bytes();
    if (queued > 0 && queued + bytes > max_bytes) {  // one batch alone always goes
      refused_ = true;
      return false;
    }
    if (!answered_) {
      if (early_.empty()) early_since_ = absl::Now();
      early_bytes_ += bytes;
      early_.push_back({graph, std::move(batch)});  // until the peer says how, and it works
    } else if (stream_) {
      stream_->Enqueue(graph, batch);
    } else {
      grpc_->Enqueue(graph, std::move(batch), bytes);
    }
    return true;
  }
  // What waits for the peer, and whether a batch for it was refused.
  std::pair<Backlog, bool> backlog() {
    absl::MutexLock lock(&mu_);
    Backlog held;
    if (!early_.empty()) held = {early_bytes_, early_since_};
    if (stream_) held += stream_->backlog();
    if (grpc_) held += grpc_->backlog();
    return {held, refused_};
  }
  int64_t written() {
    absl::MutexLock lock(&mu_);
    if (!answered_) return 0;
    return stream_ ? stream_->written() : grpc_->written();
  }

 private:
  static constexpr absl::Duration kAskFor = absl::Seconds(10);
  // The peer said where its stream listener is (or that it has none): try it.
  void Answered(const grpc::Status& status) {
    const int port = status.ok() ? response_.port() : 0;
    const std::string ip = HostOfAddress(host_);
    absl::MutexLock lock(&mu_);
    if (port > 0 && port <= 65535 && !ip.empty() && close_deadline_ == absl::InfiniteFuture()) {
      stream_ = std::make_unique<StreamPeer>(
          self_, host_, ip, port, [this](const absl::Status& s) { Connected(s); }, [this] { return AskPort(); },
          [this] { Lost(); });
    } else {
      UseGrpcLocked();
    }
  }
  // Where the peer's stream listener is now (it may have restarted on another port); 0 when it
  // does not say. Blocks a little: asked from the stream peer's own thread. Closing ends the
  // wait (a peer gone for good would otherwise hold this process's exit for the whole ask).
  int AskPort() {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);  // a peer restarting is waited for, a little
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    AttachCallToken(context);
    rpc::StreamPortResponse response;
    {
      absl::MutexLock lock(&mu_);
      if (close_deadline_ != absl::InfiniteFuture()) return 0;
      asking_ = &context;
    }
    const grpc::Status s = stub_->StreamPort(&context, rpc::StreamPortRequest(), &response);
    {
      absl::MutexLock lock(&mu_);
      asking_ = nullptr;
    }
    return s.ok() && response.port() > 0 && response.port() <= 65535 ? response.port() : 0;
  }
  // The first connection worked (TCP from now on) or did not (gRPC, for good: a listener this
  // process cannot reach, a firewall, a peer at its connection cap).
  void Connected(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() || close_deadline_ != absl::InfiniteFuture()) {
      if (!status.ok()) PW_LOG(Info) << "dataflow to " << host_ << " goes over gRPC: " << status;
      failed_ = std::move(stream_);  // its thread is ending; it goes with this object
      UseGrpcLocked();
      return;
    }
    for (const auto& [graph, batch] : early_) stream_->Enqueue(graph, batch);
    early_.clear();
    early_bytes_ = 0;
    answered_ = true;
  }
  // The stream gave up on the peer after it had worked (connections refused: the receiver's
  // slots all taken, its stream port gone): what it still holds, and everything after, goes over
  // gRPC, in order (Enqueue holds mu_ too, so nothing slips in between).
  void Lost() {
    absl::MutexLock lock(&mu_);
    if (stream_ == nullptr) {
      PW_LOG(Warning) << "dataflow to " << host_ << ": the stream gave up while the transport closed; what it held is dropped";
      return;
    }
    std::deque<std::string> frames = stream_->TakeQueued();
    given_up_ = std::move(stream_);  // its thread is ending; it goes with this object
    grpc_ = std::make_unique<GrpcPeerStream>(self_, host_);
    for (const std::string& frame : frames) {
      std::string graph;
      std::vector<Envelope> envelopes;
      // Frames this process made: they parse.
      if (frame.size() >= 4 && DecodeDataflowBatch(frame.data() + 4, frame.size() - 4, &graph, &envelopes)) {
        const int64_t bytes = HeldBytes(envelopes);
        grpc_->Enqueue(graph, std::move(envelopes), bytes);
      }
    }
    if (close_deadline_ != absl::InfiniteFuture()) grpc_->BeginClose(close_deadline_);
  }
  void UseGrpcLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    grpc_ = std::make_unique<GrpcPeerStream>(self_, host_);
    for (auto& [graph, batch] : early_) {
      const int64_t bytes = HeldBytes(batch);
      grpc_->Enqueue(graph, std::move(batch), bytes);
    }
    early_.clear();
    early_bytes_ = 0;
    if (close_deadline_ != absl::InfiniteFuture()) grpc_->BeginClose(close_deadline_);
    answered_ = true;
  }

  const std::string self_, host_;
  std::unique_ptr<rpc::Dataflow::Stub> stub_;
  grpc::ClientContext context_;
  rpc::StreamPortRequest request_;
  rpc::StreamPortResponse response_;
  absl::Mutex mu_;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::pair<std::string, std::vector<Envelope>>> early_ ABSL_GUARDED_BY(mu_);
  int64_t early_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // HeldBytes of early_
  bool refused_ ABSL_GUARDED_BY(mu_) = false;     // a batch was refused: more would have waited
  absl::Time early_since_ ABSL_GUARDED_BY(mu_);  // when the first of early_ came
  grpc::ClientContext* asking_ ABSL_GUARDED_BY(mu_) = nullptr;  // AskPort's call in flight
  absl::Time close_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::unique_ptr<StreamPeer> stream_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StreamPeer> failed_ ABSL_GUARDED_BY(mu_);  // a first connection that did not work
  std::unique_ptr<StreamPeer> given_up_ ABSL_GUARDED_BY(mu_);  // one that stopped working later
  std::unique_ptr<GrpcPeerStream> grpc_ ABSL_GUARDED_BY(mu_);
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
  bytes_sent_.fetch_add(PayloadBytes(batch), std::memory_order_relaxed);
  if (DataflowService::DeliverInProcess(self_host_, host, graph, batch)) {
    in_process_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::shared_ptr<Peer> peer;  // a peer forgotten meanwhile goes when this call is done with it
  {
    absl::MutexLock lock(&mu_);
    auto& slot = peers_[host];
    if (!slot) slot = std::make_shared<Peer>(self_host_, host);
    peer = slot;
  }
  // A peer that takes nothing while batches for it keep coming would fill this process: past
  // the bound they are refused, and Stalled names the peer (what it should have had is lost, so
  // the cluster must make it, or this host, leave).
  const int64_t max_bytes = max_peer_bytes_.load(std::memory_order_relaxed);
  const bool taken = peer->Enqueue(graph, std::move(batch), max_bytes);
  if (peer.use_count() == 1) {
    // Forgotten meanwhile, and this call its last holder: taken apart where Forget would have.
    RpcCompletions().Schedule([gone = std::move(peer)]() mutable { gone.reset(); });
  }
  if (!taken) {
    const int64_t refused = refused_batches_.fetch_add(1, std::memory_order_relaxed) + 1;
    if ((refused & (refused - 1)) == 0) {  // the 1st, 2nd, 4th, ...: a stalled peer does not flood the log
      PW_LOG(Error) << "dataflow: a batch for " << host << " refused: more than " << max_bytes
                    << " bytes would wait for it; " << refused << " refused so far";
    }
  }
}

void GrpcTransport::Forget(const std::string& host) {
  std::shared_ptr<Peer> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(host);
    if (it == peers_.end()) return;
    gone = std::move(it->second);
    peers_.erase(it);
  }
  gone->BeginClose(absl::Now());  // nothing more is written to it
  // Taking it apart joins its stream's thread, which may be waiting on the departed host for a
  // second or two: not on the caller's thread (a heartbeat).
  RpcCompletions().Schedule([gone = std::move(gone)]() mutable { gone.reset(); });
}

std::vector<GrpcTransport::PeerBacklog> GrpcTransport::Stalled(absl::Duration limit) const {
  std::vector<std::pair<std::string, std::shared_ptr<Peer>>> peers;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [host, peer] : peers_) peers.emplace_back(host, peer);
  }
  const absl::Time now = absl::Now();
  std::vector<PeerBacklog> stalled;
  for (const auto& [host, peer] : peers) {
    const auto [held, refused] = peer->backlog();
    const absl::Duration waited = held.bytes > 0 ? now - held.since : absl::ZeroDuration();
    if (refused || (held.bytes > 0 && waited >= limit)) stalled.push_back({host, held.bytes, waited, refused});
  }
  return stalled;
}

int64_t GrpcTransport::messages_written() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [host, peer] : peers_) n += peer->written();
  return n;
}

int64_t GrpcTransport::batches_in_process() const { return in_process_.load(std::memory_order_relaxed); }

}  // namespace pathways::dataflow
