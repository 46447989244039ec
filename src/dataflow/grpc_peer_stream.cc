#include "dataflow/grpc_peer_stream.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/tsan.h"
#include "dataflow/dataflow_service.h"
#include "grpcpp/create_channel.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways::dataflow {
namespace {

// What an envelope adds to a message beyond its payload, at most (its ids and framing).
constexpr size_t kEnvelopeOverhead = 64;

int64_t HeldBytes(const rpc::DataflowBatch& message) {
  int64_t bytes = 0;
  for (const rpc::DataflowEnvelope& e : message.envelopes()) {
    bytes += static_cast<int64_t>(e.payload().size() + kEnvelopeOverhead);
  }
  return bytes;
}

}  // namespace

int64_t HeldBytes(const std::vector<Envelope>& batch) {
  return PayloadBytes(batch) + static_cast<int64_t>(batch.size() * kEnvelopeOverhead);
}

// One gRPC call. Held (AddHold) while the stream may still write to it, so gRPC does not finish
// it under a write started from outside its reactions. Kept until the stream goes (calls are
// few: one, plus one per broken stream).
class GrpcPeerStream::Call : public grpc::ClientWriteReactor<rpc::DataflowBatch> {
 public:
  explicit Call(GrpcPeerStream& owner) : owner_(owner) {}
  // gRPC's core runs the reactions on its threads: what Take() did before it started the
  // operation they end comes first (core/tsan.h).
  void OnWriteDone(bool ok) override {
    TsanAcquire(this);
    owner_.WriteDone(ok);
  }
  void OnDone(const grpc::Status& status) override {
    TsanAcquire(this);
    owner_.CallDone(status);
  }
  grpc::ClientContext context;
  rpc::DataflowAck ack;
  rpc::DataflowBatch message;  // the one being written

 private:
  GrpcPeerStream& owner_;
};

GrpcPeerStream::GrpcPeerStream(const std::string& self, const std::string& peer)
    : self_(self), peer_(peer), stub_(rpc::Dataflow::NewStub(grpc::CreateChannel(peer, ChannelCredentials()))) {}

void GrpcPeerStream::BeginClose(absl::Time deadline) {
  Steps steps;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    close_deadline_ = std::min(close_deadline_, deadline);
    steps = PumpLocked();
  }
  Take(steps);
}

GrpcPeerStream::~GrpcPeerStream() {
  BeginClose(absl::Now() + absl::Seconds(2));
  std::vector<Call*> to_cancel;
  {
    absl::MutexLock lock(&mu_);
    auto finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return live_calls_ == 0; };
    if (mu_.AwaitWithDeadline(absl::Condition(&finished), close_deadline_)) return;
    cancelled_ = true;  // nothing more is written, and no call opened
    for (const auto& c : calls_) to_cancel.push_back(c.get());
  }
  for (Call* c : to_cancel) c->context.TryCancel();  // calls live until this object goes
  absl::MutexLock lock(&mu_);
  auto finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return live_calls_ == 0; };
  mu_.Await(absl::Condition(&finished));  // cancelled calls end promptly
}

void GrpcPeerStream::Enqueue(const std::string& graph, std::vector<Envelope> batch, int64_t held) {
  Steps steps;
  {
    absl::MutexLock lock(&mu_);
    if (held_bytes_ == 0) progress_ = absl::Now();  // waiting starts now
    held_bytes_ += held;
    pending_.push_back({graph, std::move(batch)});
    steps = PumpLocked();
  }
  Take(steps);
}

Backlog GrpcPeerStream::backlog() {
  absl::MutexLock lock(&mu_);
  if (held_bytes_ == 0) return {};
  return {held_bytes_, progress_};
}

int64_t GrpcPeerStream::queued_bytes() {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

int64_t GrpcPeerStream::written() {
  absl::MutexLock lock(&mu_);
  return written_;
}

void GrpcPeerStream::MergePendingLocked() {
  // Everything queued since the last write goes out together: one message per graph, each
  // within the frame bound the receivers take (a graph's batches stay in order).
  std::map<std::string, std::vector<rpc::DataflowBatch>> merged;
  std::map<std::string, size_t> last_bytes;  // of each graph's last message, at most
  for (const auto& [graph, batch] : pending_) {
    std::vector<rpc::DataflowBatch>& ms = merged[graph];
    size_t bytes = 0;
    for (const Envelope& e : batch) bytes += e.payload.size() + kEnvelopeOverhead;
    size_t& last = last_bytes[graph];
    if (ms.empty() || last + bytes > kMaxDataflowFrameBytes / 2) {
      ms.emplace_back().set_graph(graph);
      ms.back().set_src_host(self_);
      last = graph.size() + self_.size() + kEnvelopeOverhead;
    }
    last += bytes;
    for (const Envelope& e : batch) EnvelopeToProto(e, ms.back().add_envelopes());
  }
  pending_.clear();
  for (auto& [graph, ms] : merged) {
    for (rpc::DataflowBatch& m : ms) messages_.push_back(std::move(m));
  }
}

GrpcPeerStream::Steps GrpcPeerStream::PumpLocked() {
  Steps steps;
  if (writing_) return steps;
  if (cancelled_) {
    if (!pending_.empty() || !messages_.empty()) {
      PW_LOG(Error) << "dataflow: " << pending_.size() + messages_.size() << " batches for " << peer_
                    << " dropped: the transport closed before the peer took them";
    }
    pending_.clear();
    messages_.clear();
    held_bytes_ = 0;
    return steps;
  }
  if (messages_.empty()) MergePendingLocked();
  if (messages_.empty()) {
    if (closing_ && call_ != nullptr) {
      steps.release = std::exchange(call_, nullptr);
      steps.finish = true;
    }
    return steps;
  }
  if (call_ == nullptr) {
    calls_.push_back(std::make_unique<Call>(*this));
    call_ = calls_.back().get();
    call_->context.set_wait_for_ready(true);  // a peer still starting is waited for
    AttachCallToken(call_->context);
    ++live_calls_;
    stub_->async()->Stream(&call_->context, &call_->ack, call_);
    call_->AddHold();
    steps.start = call_;
  }
  writing_ = true;
  call_->message = messages_.front();
  steps.write = call_;
  return steps;
}

void GrpcPeerStream::Take(const Steps& steps) {
  for (Call* c : {steps.release, steps.start, steps.write}) {
    if (c != nullptr) TsanRelease(c);  // handed to gRPC's core, which completes it on its threads
  }
  if (steps.release != nullptr) {
    if (steps.finish) steps.release->StartWritesDone();
    steps.release->RemoveHold();
  }
  if (steps.start != nullptr) steps.start->StartCall();
  if (steps.write != nullptr) steps.write->StartWrite(&steps.write->message);
}

void GrpcPeerStream::WriteDone(bool ok) {
  Steps steps;
  Call* broken = nullptr;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (ok) {
      held_bytes_ -= HeldBytes(messages_.front());
      progress_ = absl::Now();
      messages_.pop_front();
      ++written_;
      attempts_ = 0;
    } else {
      // The stream broke (the peer went away or restarted): open another and try again.
      broken = std::exchange(call_, nullptr);
      if (closing_ || ++attempts_ == kAttempts) {
        PW_LOG(Error) << "dataflow: " << messages_.front().envelopes_size() << " envelopes for " << peer_
                      << " dropped: "
                      << (closing_ ? std::string("the transport is closing")
                                   : absl::StrCat(attempts_, " streams broke"));
        held_bytes_ -= HeldBytes(messages_.front());
        messages_.pop_front();
        attempts_ = 0;
      }
    }
    steps = PumpLocked();
  }
  if (broken != nullptr) broken->RemoveHold();
  Take(steps);
}

void GrpcPeerStream::CallDone(const grpc::Status& status) {
  if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
    PW_LOG(Info) << "dataflow stream to " << peer_ << " ended: " << status.error_message();
  }
  absl::MutexLock lock(&mu_);
  --live_calls_;
}

}  // namespace pathways::dataflow
