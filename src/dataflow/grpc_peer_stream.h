// One sending host's long-lived gRPC stream of dataflow batches to one peer: the way batches go
// when the plain TCP streams (dataflow/stream_peer.h) cannot be used (TLS is on here or at the
// peer, or the peer has no stream listener).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataflow/engine.h"
#include "dataflow/stream_peer.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways::dataflow {

// What a batch holds in a sender's queue: its payloads and their envelopes (a punctuation, which
// closes an epoch, has no payload and matters as much). A plain TCP peer counts its frames'
// bytes instead, which differ by their framing.
int64_t HeldBytes(const std::vector<Envelope>& batch);

// One client stream to one peer, on gRPC's callback API: no thread of its own, and no thread
// waits for a peer that is slow or still starting (the call waits for the channel). One message
// is written at a time; batches queued meanwhile go out merged, one message per graph. A stream
// that breaks is opened again and the message whose write failed is written again, a bounded
// number of times. Thread-safe.
//
// gRPC may run a reaction inline in the thread that starts an operation, so operations are
// decided under mu_ and started after it is released (Steps).
class GrpcPeerStream {
 public:
  GrpcPeerStream(const std::string& self, const std::string& peer);
  // Queued messages get until `deadline` to go out; then the stream is cut: a peer that went
  // away must not hold up shutdown.
  void BeginClose(absl::Time deadline);
  // Closes (BeginClose in 2 s at the latest), then cancels what is still open.
  ~GrpcPeerStream();
  // `held`: HeldBytes(batch).
  void Enqueue(const std::string& graph, std::vector<Envelope> batch, int64_t held);
  // The bytes not yet written (HeldBytes), and since when none was.
  Backlog backlog();
  int64_t queued_bytes();
  // Messages written.
  int64_t written();

 private:
  class Call;
  // What to start once mu_ is released, in this order.
  struct Steps {
    Call* release = nullptr;  // done with it: (writes done, if `finish`) and drop the hold
    bool finish = false;
    Call* start = nullptr;  // a new call to start
    Call* write = nullptr;  // write its `message`
  };
  // Decides the next write, opening a call if needed; once closing and drained, ends the call.
  Steps PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Merges what is pending into messages, one per graph, each within the frame bound.
  void MergePendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Take(const Steps& steps);
  void WriteDone(bool ok);
  void CallDone(const grpc::Status& status);

  static constexpr int kAttempts = 3;
  const std::string self_;
  const std::string peer_;
  std::unique_ptr<rpc::Dataflow::Stub> stub_;
  absl::Mutex mu_;
  std::vector<std::pair<std::string, std::vector<Envelope>>> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<rpc::DataflowBatch> messages_ ABSL_GUARDED_BY(mu_);  // merged, the front one being written
  std::vector<std::unique_ptr<Call>> calls_ ABSL_GUARDED_BY(mu_);
  Call* call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the call written to; null: none open
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;    // calls gRPC is not done with
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int attempts_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // closing, and out of time
  absl::Time close_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  // HeldBytes of pending_ and messages_, and when a message last went out or the first
  // batch was queued.
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::dataflow
