// The receiving side of the dataflow engine's batches between hosts: a gRPC service, a plain TCP
// stream protocol, and a directory of the services of this process for batches that stay in it.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataflow/engine.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/stream_listener.h"

namespace pathways::dataflow {

// Payload bytes of a batch's envelopes.
int64_t PayloadBytes(const std::vector<Envelope>& batch);

// What a graph lost on this host before its engine was registered: the epochs of batches dropped
// past a bound, or held too long. Whoever runs those epochs here must fail them with `why`: an
// epoch that lost a batch never ends, and what the batch carried never comes.
struct LostEpochs {
  // At most this many epochs are listed; past it, every epoch from the smallest to the largest
  // one lost counts (what a flood can make a host remember stays small). A merge of several
  // senders' losses keeps each one's range.
  static constexpr size_t kMaxListed = 64;
  absl::flat_hash_set<int64_t> epochs;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // first, last
  std::string why;  // the first drop's reason; empty: nothing was lost
  bool Has(int64_t epoch) const;
  bool empty() const { return why.empty(); }
  void Add(int64_t epoch);
  void Add(const std::vector<Envelope>& batch, const std::string& reason);
  void Merge(const LostEpochs& other);
};

// Receives batches for the engines registered with it (by graph name) and hands them over.
// Batches for a graph not registered yet are held until it is: hosts set up a graph
// independently, and a fast peer may send before this host has its engine. What is held is
// bounded by count and by bytes: in all, per graph and per sending peer (peers cannot fill the
// host's memory with batches for graphs nobody registers, and one peer cannot take the room of
// the others). The island control graphs' batches have room of their own, so programs' batches
// never crowd them out. Past a bound a batch is dropped, and the graph's engine, when it comes,
// is told which epochs lost a batch and why (AddEngine). Thread-safe.
class DataflowService final : public rpc::Dataflow::CallbackService {
 public:
  static constexpr size_t kMaxHeldBatches = 100000;
  // Plain TCP senders served at once (one per sending process; only the cluster's token opens
  // one), counted apart from tenants' streams on the same listener.
  static constexpr int kMaxStreamSenders = 4096;
  static constexpr size_t kMaxHeldBytes = size_t{256} << 20;
  static constexpr size_t kMaxHeldBytesPerGraph = size_t{64} << 20;
  static constexpr size_t kMaxHeldBytesPerPeer = size_t{128} << 20;
  // For the island control graphs' batches (a few hundred bytes each), apart from the rest.
  static constexpr size_t kMaxHeldControlBytes = size_t{16} << 20;
  // A graph not registered this long after its first batch came will not be: when room is
  // needed, what it held goes.
  static constexpr absl::Duration kHoldFor = absl::Seconds(60);
  // Tests: lower byte bounds.
  void SetHoldLimits(size_t bytes, size_t bytes_per_graph, size_t bytes_per_peer) {
    absl::MutexLock lock(&mu_);
    programs_.max_bytes = bytes;
    max_held_bytes_per_graph_ = bytes_per_graph;
    max_held_bytes_per_peer_ = bytes_per_peer;
  }
  ~DataflowService() override;  // leaves the in-process directory
  // Also takes batches for `address` from transports in this process directly, until
  // StopServingInProcess (or destruction, or another service taking the address). Call once the
  // address is known.
  void ServeInProcess(const std::string& address);
  void StopServingInProcess();
  // Hands a batch from host `from` to the graph's engine, or holds it until the graph is
  // registered. `on_reader`: the caller is a thread that reads one connection's batches, on
  // which an engine that handles_on_arrival() handles them (not a sender's own thread, as
  // in-process delivery is, which may hold its engine's locks).
  void Receive(const std::string& from, const std::string& graph, std::vector<Envelope> batch, bool on_reader = false);
  // Hands `batch` to the service serving `host` in this process, if one does (under the
  // directory's reader lock, so that a service leaving waits for it): whether one did.
  static bool DeliverInProcess(const std::string& from, const std::string& host, const std::string& graph,
                               std::vector<Envelope>& batch);
  // Streams must carry this token (see transport/auth.h); empty: none needed. Set before serving.
  void RequireToken(std::string token) { token_ = std::move(token); }

  // The owner removes an engine before letting it go. Batches that come for a graph removed
  // recently (the last kRememberedRemoved) are dropped, not held: stragglers of a finished
  // program or an old control graph generation.
  static constexpr size_t kRememberedRemoved = 4096;
  // Hands the engine what was held for its graph, and returns the epochs that lost a batch from
  // one of the graph's hosts before it came (batches from others cannot be the graph's). Losses
  // are remembered for the last kRememberedLost graphs, from at most kMaxLostSenders senders
  // each; those of any further sender count for every host (a flood of made-up senders must not
  // push a real one out).
  static constexpr size_t kRememberedLost = 256;
  static constexpr size_t kMaxLostSenders = 16;
  [[nodiscard]] LostEpochs AddEngine(Engine* engine);
  // Graph names and senders' names are this long at most; a batch naming a longer graph is
  // dropped (and not remembered), a longer sender's name is cut.
  static constexpr size_t kMaxNameBytes = 256;
  void RemoveEngine(const std::string& graph);
  // Payload bytes of every envelope received, held or dropped ones too.
  int64_t bytes_received() const { return bytes_received_.load(std::memory_order_relaxed); }
  size_t num_held_batches();
  size_t num_held_bytes();
  // Batches dropped for a graph not registered here (past a bound, held too long, a name too
  // long); stragglers of removed graphs are not counted.
  int64_t batches_dropped() const { return dropped_.load(std::memory_order_relaxed); }
  // Waits until at least `n` batches were dropped (tests): whether they were within `timeout`.
  bool WaitForDrops(int64_t n, absl::Duration timeout) {
    auto enough = [this, n] { return batches_dropped() >= n; };
    absl::MutexLock lock(&mu_);  // every drop is counted under mu_
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
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
  // StreamPort also answers calls of these tenants (the controller's listener serves tenants'
  // schedule streams too, and tenants hold only their own token). Set before serving.
  void AnswerStreamPortTo(TenantTokens tenants) { port_tenants_ = std::move(tenants); }
  // Batches that came over plain TCP streams.
  int64_t batches_streamed() const { return streamed_.load(std::memory_order_relaxed); }

 private:
  class Reader;
  std::atomic<int64_t> bytes_received_{0};
  std::atomic<int64_t> dropped_{0};
  // Counts a dropped batch; whether to log it.
  bool CountDrop();
  // What a held batch costs beyond its envelopes, names aside.
  static constexpr size_t kHeldBatchOverhead = 64;
  absl::Mutex mu_;
  std::map<std::string, Engine*> engines_ ABSL_GUARDED_BY(mu_);
  struct HeldBatch {
    std::string from;
    std::vector<Envelope> envelopes;
    size_t bytes = 0;
  };
  // What is held, in two pools: the island control graphs' and the rest.
  struct Pool {
    size_t batches = 0;
    size_t bytes = 0;
    size_t max_bytes = 0;
    absl::flat_hash_map<std::string, size_t> by_peer;  // bytes held from each sender
  };
  struct Held {
    Pool* pool = nullptr;
    std::vector<HeldBatch> batches;
    size_t bytes = 0;
    absl::Time since;  // when its first batch came
  };
  Pool& PoolOf(const std::string& graph) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops what has been held longer than kHoldFor for graphs that never came.
  void DropStaleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a graph's held batches out of its pool's counts.
  void ReleaseLocked(const Held& held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers that `graph` lost `batch` from `from`, and why.
  void LoseLocked(const std::string& graph, const std::string& from, const std::vector<Envelope>& batch,
                  const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
  Pool programs_ ABSL_GUARDED_BY(mu_){.max_bytes = kMaxHeldBytes};
  Pool control_ ABSL_GUARDED_BY(mu_){.max_bytes = kMaxHeldControlBytes};
  // What a graph lost, by sender; `others` for senders past kMaxLostSenders.
  struct Losses {
    std::map<std::string, LostEpochs> senders;
    LostEpochs others;
  };
  std::map<std::string, Losses> lost_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> lost_order_ ABSL_GUARDED_BY(mu_);
  absl::Time next_stale_scan_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  size_t max_held_bytes_per_graph_ ABSL_GUARDED_BY(mu_) = kMaxHeldBytesPerGraph;
  size_t max_held_bytes_per_peer_ ABSL_GUARDED_BY(mu_) = kMaxHeldBytesPerPeer;
  absl::flat_hash_set<std::string> removed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> removed_order_ ABSL_GUARDED_BY(mu_);
  std::string token_;
  std::optional<TenantTokens> port_tenants_;  // unset: hosts only
  std::atomic<int> stream_port_{0};
  std::atomic<int64_t> streamed_{0};
  std::string in_process_address_;  // guarded by the in-process directory's lock
};

}  // namespace pathways::dataflow
