// The dataflow engine across processes: long-lived gRPC streams, one per (sending host,
// receiving host), carrying batches of envelopes in order.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataflow/engine.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways::dataflow {

// Sends batches to other hosts' DataflowService, for any number of graphs. Thread-safe. A peer
// served in this same process (see DataflowService::ServeInProcess) gets its batches handed over
// directly: no network, no serialisation, no extra thread. Every other peer gets one plain TCP
// connection to its stream listener (dataflow/stream_peer.h) when it has one, else one stream on
// gRPC's callback API (no thread per peer; batches queued while a write is in progress go out
// merged, one message per graph).
class GrpcTransport : public Transport {
 public:
  explicit GrpcTransport(std::string self_host);
  ~GrpcTransport() override;  // finishes every stream
  void Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) override;
  // Batches written to the network; fewer than Send calls when batches merged.
  int64_t messages_written() const;
  // Batches handed to peers in this process.
  int64_t batches_in_process() const;
  // Payload bytes of every envelope sent, to peers in this process too.
  int64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  // What waits for one peer: bytes of batches not yet written, and how long nothing of them went
  // out.
  struct PeerBacklog {
    std::string host;
    int64_t bytes = 0;
    absl::Duration stalled;
    bool refused = false;  // batches for it were refused (kMaxPeerBytes): some of its data is lost
  };
  // Peers that took nothing of what waits for them for `limit` or longer (cut off from this
  // host, or frozen), and peers whose batches were refused.
  std::vector<PeerBacklog> Stalled(absl::Duration limit) const;
  // At most this many bytes wait for one peer; batches beyond are refused (and counted).
  static constexpr int64_t kMaxPeerBytes = int64_t{256} << 20;
  void SetMaxPeerBytes(int64_t bytes) { max_peer_bytes_ = bytes; }  // tests
  int64_t refused_batches() const { return refused_batches_.load(std::memory_order_relaxed); }
  // `host` left the cluster: what waits for it is dropped, with its connection and its refusal.
  // A later batch for the address starts afresh, as for a new worker there. Does not block: the
  // peer is taken apart on another thread.
  void Forget(const std::string& host);

 private:
  class Peer;
  const std::string self_host_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> max_peer_bytes_{kMaxPeerBytes};
  std::atomic<int64_t> refused_batches_{0};
  std::atomic<int64_t> in_process_{0};
  std::atomic<int64_t> bytes_sent_{0};
};

}  // namespace pathways::dataflow
