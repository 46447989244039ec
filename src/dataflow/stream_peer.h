// Dataflow batches over a plain TCP connection instead of a gRPC stream: a batch is written to
// the socket by the thread that sends it (no hand-off to gRPC's threads, which cost 100-200 µs
// per hop on the round trip of a small computation), and read by a thread that hands it straight
// to the graph's engine.
//
// The protocol, on a connection to the receiver's stream listener (transport/stream_listener.h):
//   sender: the hello with magic kDataflowStreamMagic and the cluster token;
//   receiver: a header frame, OK once admitted (or why not, and the connection closes);
//   sender, per batch: u32 n (little-endian), a serialized rpc::DataflowBatch of n bytes (at
//     most kMaxDataflowFrameBytes).
// Nothing else flows back: TCP keeps the batches in order, as the gRPC stream did.
#pragma once

#include <cstdint>
#include <algorithm>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataflow/engine.h"
#include "proto/pathways.pb.h"
#include "transport/stream_listener.h"

namespace pathways::dataflow {

inline constexpr char kDataflowStreamMagic[] = "PWFLOW01";
inline constexpr uint32_t kMaxDataflowFrameBytes = 256u << 20;

void EnvelopeToProto(const Envelope& e, rpc::DataflowEnvelope* p);
Envelope EnvelopeFromProto(rpc::DataflowEnvelope& p);  // takes the payload
// A serialized rpc::DataflowBatch (a frame after its length) as its graph and envelopes; false
// when it does not parse.
bool DecodeDataflowBatch(const char* data, size_t size, std::string* graph, std::vector<Envelope>* envelopes,
                         std::string* from = nullptr);
// The frame of one batch (its length, then the batch).
std::string DataflowFrame(const std::string& self, const std::string& graph, const std::vector<Envelope>& batch);
// The dataflow streams of a StreamListener, for senders that show `token`: every batch that
// comes is handed to `receive`, on the listener's one reader thread for all of them (so it must
// not block). A batch that does not parse closes its connection (logged). At most
// `max_connections` senders at once (0: the listener's bound).
StreamListener::Protocol DataflowStreamProtocol(
    std::string token,
    std::function<void(const std::string& from, const std::string& graph, std::vector<Envelope>)> receive,
    int max_connections = 0);

// What a sender holds for one peer: its bytes, and since when none of it went out (progress).
// `since` is InfiniteFuture while nothing is held.
struct Backlog {
  int64_t bytes = 0;
  absl::Time since = absl::InfiniteFuture();
  // Both held here and there: the bytes add up, the oldest wait counts.
  Backlog& operator+=(const Backlog& other) {
    bytes += other.bytes;
    since = std::min(since, other.since);
    return *this;
  }
};

// One long-lived connection to one peer's stream listener, for any number of graphs.
// Thread-safe. It connects first, and says whether that worked (`connected`, on its thread);
// one that did not takes nothing more (the caller sends another way). Enqueue writes the batch
// itself when the connection is idle and the socket takes it whole; otherwise it is queued for
// this peer's thread (started then, if it had ended for want of work), which connects, writes what is queued
// (merged into one write), and reconnects when the connection breaks, writing again the batches
// whose write failed, a bounded number of times; then it gives up: with a `lost` callback it
// stops, keeping what is queued for TakeQueued (the caller sends it another way), else it drops
// the batch and tries again with the next.
class StreamPeer {
 public:
  // `self` names this sender in batches; `peer` names the receiver in logs; it listens on
  // `ip`:`port`. `connected` runs once, on this peer's thread, with none of its locks held.
  // `resolve` (optional) says where the peer listens now, asked before connecting again: a peer
  // that restarted listens on another port (0: do not know). `lost` (optional) runs once, on this
  // peer's thread with none of its locks held, when it gives up on the peer.
  StreamPeer(std::string self, std::string peer, std::string ip, int port,
             std::function<void(const absl::Status&)> connected, std::function<int()> resolve = nullptr,
             std::function<void()> lost = nullptr);
  ~StreamPeer();  // gives queued batches up to BeginClose's deadline (2 s by default), then cuts
  StreamPeer(const StreamPeer&) = delete;
  StreamPeer& operator=(const StreamPeer&) = delete;

  void Enqueue(const std::string& graph, const std::vector<Envelope>& batch);
  // Queued batches get until `deadline` to go out; then the connection is cut.
  void BeginClose(absl::Time deadline);
  // Batches written, whole (tests, counters). A receiver may have a batch before it is counted:
  // WaitUntilWritten waits for the count (false when `timeout` passed first).
  int64_t written();
  bool WaitUntilWritten(int64_t batches, absl::Duration timeout);
  // The frames (DataflowFrame) not written, oldest first, taken out: after `lost`.
  std::deque<std::string> TakeQueued();
  // The frames not yet written whole, and since when none was; with what the connection holds
  // unacknowledged, and since the peer last acknowledged anything.
  Backlog backlog();
  // The bytes of the frames not yet written whole (no system call: for every batch sent).
  int64_t queued_bytes();

  // A connection idle this long is closed by the sender (receivers close theirs after longer, so
  // a batch is never written into a connection the receiver is closing): at its next batch.
  static constexpr absl::Duration kIdle = absl::Minutes(4);
  // The peer's thread ends once it has had nothing to do for this long; the next batch the
  // socket does not take whole starts another. Most batches are written by their callers, so a
  // controller of 512 hosts keeps threads only for the peers that lag.
  static constexpr absl::Duration kThreadIdle = absl::Seconds(1);
  // Connections tried for a batch before it is dropped, 50 ms apart and doubling (1.5 s in all:
  // a peer restarting is back by then, or its batches are for an incarnation that is gone).
  static constexpr int kAttempts = 5;

 private:
  struct Frame {
    std::string bytes;
    size_t sent = 0;  // of a frame being written
  };
  // Connects and reads the admission, within kConnect and by `deadline`.
  absl::StatusOr<int> Connect(absl::Time deadline);
  void Loop();
  // Writes the frames taken; false when the connection broke (the rest are put back).
  bool WriteFrames(int fd, std::deque<Frame>& frames);

  const std::string self_, peer_, ip_;
  int port_;  // this peer's thread's
  std::function<void(const absl::Status&)> connected_;
  std::function<int()> resolve_;
  std::function<void()> lost_;
  absl::Mutex mu_;
  std::deque<Frame> queued_ ABSL_GUARDED_BY(mu_);
  int fd_ ABSL_GUARDED_BY(mu_) = -1;         // the connection, once made; -1: none
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // someone writes to fd_ now
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time close_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time last_write_ ABSL_GUARDED_BY(mu_);
  int attempts_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t written_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes of the frames queued or being written (not those the caller's thread wrote at once),
  // and when one was last written whole or the first was queued.
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time progress_ ABSL_GUARDED_BY(mu_);
  // When backlog() first found the connection holding bytes the peer had not acknowledged.
  absl::Time unacked_seen_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  void HoldLocked(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the thread for what is queued, unless it runs (or the peer was given up).
  void EnsureThreadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int wake_fd_ = -1;  // eventfd: wakes the thread's poll when closing
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  bool thread_running_ ABSL_GUARDED_BY(mu_) = false;  // it has not decided to end
  bool gave_up_ ABSL_GUARDED_BY(mu_) = false;         // no thread starts again
};

}  // namespace pathways::dataflow
