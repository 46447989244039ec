// The dataflow engine across processes: long-lived gRPC streams, one per (sending host,
// receiving host), carrying batches of envelopes in order.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataflow/engine.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/stream_listener.h"

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

 private:
  class PeerStream;
  class Peer;
  const std::string self_host_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> in_process_{0};
  std::atomic<int64_t> bytes_sent_{0};
};

// Receives batches for the engines registered with it (by graph name) and hands them over.
// Batches for a graph not registered yet are held until it is: hosts set up a graph
// independently, and a fast peer may send before this host has its engine. What is held is
// bounded by count and by bytes, in all and per graph (a peer cannot fill the host's memory
// with batches for graphs nobody registers); past a bound a batch is dropped with an error
// logged. Thread-safe.
class DataflowService final : public rpc::Dataflow::CallbackService {
 public:
  static constexpr size_t kMaxHeldBatches = 100000;
  // Plain TCP senders served at once (one per sending process; only the cluster's token opens
  // one), counted apart from tenants' streams on the same listener.
  static constexpr int kMaxStreamSenders = 4096;
  static constexpr size_t kMaxHeldBytes = size_t{256} << 20;
  static constexpr size_t kMaxHeldBytesPerGraph = size_t{64} << 20;
  // A graph not registered this long after its first batch came will not be: when room is
  // needed, what it held goes.
  static constexpr absl::Duration kHoldFor = absl::Seconds(60);
  // Tests: lower byte bounds.
  void SetHoldLimits(size_t bytes, size_t bytes_per_graph) {
    absl::MutexLock lock(&mu_);
    max_held_bytes_ = bytes;
    max_held_bytes_per_graph_ = bytes_per_graph;
  }
  ~DataflowService() override;  // leaves the in-process directory
  // Also takes batches for `address` from transports in this process directly, until
  // StopServingInProcess (or destruction, or another service taking the address). Call once the
  // address is known.
  void ServeInProcess(const std::string& address);
  void StopServingInProcess();
  // Hands a batch to the graph's engine, or holds it until the graph is registered.
  void Receive(const std::string& graph, std::vector<Envelope> batch);
  // Streams must carry this token (see transport/auth.h); empty: none needed. Set before serving.
  void RequireToken(std::string token) { token_ = std::move(token); }

  // The owner removes an engine before letting it go. Batches that come for a graph removed
  // recently (the last kRememberedRemoved) are dropped, not held: stragglers of a finished
  // program or an old control graph generation.
  static constexpr size_t kRememberedRemoved = 4096;
  void AddEngine(Engine* engine);
  void RemoveEngine(const std::string& graph);
  // Payload bytes of every envelope received, held or dropped ones too.
  int64_t bytes_received() const { return bytes_received_.load(std::memory_order_relaxed); }
  size_t num_held_batches();
  size_t num_held_bytes();
  // Each peer's stream, read without a thread of its own (gRPC's callback API).
  grpc::ServerReadReactor<rpc::DataflowBatch>* Stream(grpc::CallbackServerContext* context,
                                                      rpc::DataflowAck* ack) override;
  // Where this process's stream listener takes the same batches over plain TCP.
  grpc::ServerUnaryReactor* StreamPort(grpc::CallbackServerContext* context, const rpc::StreamPortRequest* request,
                                       rpc::StreamPortResponse* response) override;
  // The listener's protocol for dataflow batches (after RequireToken), and its port once it
  // listens (0: none, senders use gRPC).
  StreamListener::Protocol StreamProtocol();
  void SetStreamPort(int port) { stream_port_.store(port); }
  // StreamPort also answers calls that carry this token (the controller's listener serves
  // tenants' schedule streams too, and tenants hold only their own token). Set before serving.
  void AnswerStreamPortTo(std::string token) { port_token_ = std::move(token); }
  // Batches that came over plain TCP streams.
  int64_t batches_streamed() const { return streamed_.load(std::memory_order_relaxed); }

 private:
  class Reader;
  std::atomic<int64_t> bytes_received_{0};
  absl::Mutex mu_;
  std::map<std::string, Engine*> engines_ ABSL_GUARDED_BY(mu_);
  struct Held {
    std::vector<std::vector<Envelope>> batches;
    size_t bytes = 0;
    absl::Time since;  // when its first batch came
  };
  // Drops what has been held longer than kHoldFor for graphs that never came.
  void DropStaleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
  size_t num_held_ ABSL_GUARDED_BY(mu_) = 0;
  size_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t max_held_bytes_ ABSL_GUARDED_BY(mu_) = kMaxHeldBytes;
  size_t max_held_bytes_per_graph_ ABSL_GUARDED_BY(mu_) = kMaxHeldBytesPerGraph;
  absl::flat_hash_set<std::string> removed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> removed_order_ ABSL_GUARDED_BY(mu_);
  std::string token_;
  std::string port_token_;
  std::atomic<int> stream_port_{0};
  std::atomic<int64_t> streamed_{0};
  std::string in_process_address_;  // guarded by the in-process directory's lock
};

}  // namespace pathways::dataflow
