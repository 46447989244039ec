// One host's part of a sharded dataflow: the shards placed here, their operators, and progress
// tracking per run (epoch).
//
// Progress tracking uses counted punctuations, as in MillWheel and Naiad's per-edge counts: when a
// producer shard finishes an epoch it sends every consumer shard it could have fed a punctuation
// carrying how many messages it sent that shard on that edge (possibly zero). A consumer shard
// has finished receiving an epoch once it holds a punctuation from every producer shard that
// feeds it and as many messages as those punctuations add up to. Messages and punctuations may
// arrive in any order, over any path. A shard that receives nothing in an epoch still learns that
// the epoch is over, which is what sparse exchange needs; on announced edges (graph.h) only the
// shards sent something hear of the epoch at all. Sources finish an epoch when their input for it
// is closed.
#pragma once

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "core/executor.h"
#include "dataflow/graph.h"

namespace pathways::dataflow {

struct Envelope {
  int64_t epoch = 0;
  int32_t edge = 0;
  int32_t src_shard = 0;
  int32_t dst_shard = 0;
  bool punctuation = false;
  int64_t count = 0;  // punctuations only
  std::string payload;
};

// Moves batches of envelopes to the engine of graph `graph` on another host. One transport may
// serve many graphs. Implementations must not block for long: they queue and return.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual void Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) = 0;
};

class Engine;

// What an operator callback can do. Valid only during the callback.
class ShardContext {
 public:
  int node() const { return node_; }
  int shard() const { return shard_; }
  int64_t epoch() const { return epoch_; }
  // Sends `payload` on outgoing edge `edge` to consumer shard `dst_shard` in this epoch.
  void Send(int edge, int dst_shard, std::string payload);

 private:
  friend class Engine;
  ShardContext(Engine& engine, int node, int shard, int64_t epoch, std::map<std::pair<int, int>, int64_t>* sent)
      : engine_(engine), node_(node), shard_(shard), epoch_(epoch), sent_(sent) {}
  Engine& engine_;
  int node_, shard_;
  int64_t epoch_;
  std::map<std::pair<int, int>, int64_t>* sent_;  // the epoch's per (edge, dst shard) counts
};

// The code of one shard of a node. Callbacks of one shard never run concurrently.
class Operator {
 public:
  virtual ~Operator() = default;
  // Source input injected with Engine::Inject (edge is -1), or a message on incoming `edge`.
  virtual void OnMessage(ShardContext& ctx, int edge, int src_shard, const std::string& payload) = 0;
  // Everything this shard will receive in the epoch has arrived. After this returns, its output
  // for the epoch is complete.
  virtual void OnEpochDone(ShardContext& ctx) = 0;
};

using OperatorFactory = std::function<std::unique_ptr<Operator>(int node, int shard)>;

// Thread-safe. Work runs on `executor`; the engine never blocks in it. Owned by shared_ptr (make
// it with std::make_shared): work queued on the executor holds the engine, so a batch that
// arrives while its owner lets go is handled or dropped, never run on a destroyed engine.
class Engine : public std::enable_shared_from_this<Engine> {
 public:
  static constexpr size_t kRememberedEpochs = 4096;

  Engine(std::string host, std::shared_ptr<const GraphDef> graph, OperatorFactory factory,
         Transport& transport, Executor& executor);

  const std::string& host() const { return host_; }
  const GraphDef& graph() const { return *graph_; }

  // Source input for a shard of a node without incoming edges, hosted here.
  absl::Status Inject(int node, int shard, int64_t epoch, std::string payload);
  // No more source input for the epoch at this source shard.
  absl::Status CloseInput(int node, int shard, int64_t epoch);
  // The source shard's whole input for the epoch: injected and closed, leaving together.
  absl::Status InjectAll(int node, int shard, int64_t epoch, std::vector<std::string> payloads);
  // A batch from another host (or this one). Processed in order on the executor.
  void Deliver(std::vector<Envelope> batch);
  // The same, on the calling thread: for the thread that reads the batches of the streams
  // (DataflowService, when handles_on_arrival()).
  void Handle(const std::vector<Envelope>& batch);
  // Whether a batch read from a stream is handled on the reader's thread instead of the
  // executor's: one wake-up less per batch, for graphs whose operators never block (control
  // graphs: their operators queue work and send without waiting). That thread reads every
  // sender's stream (transport/stream_listener.h), so an operator that blocked would hold every
  // sender's batches, not only its own. Set before the engine is added to a service.
  void set_handles_on_arrival(bool on) { handles_on_arrival_ = on; }
  bool handles_on_arrival() const { return handles_on_arrival_; }
  // Stops calling operators: callbacks in progress finish first, later input is dropped and
  // nothing more is sent. Work already queued holds the engine, not its operators' owner, so an
  // owner whose operators refer to it calls this before it goes (see OwnedEngines), and never
  // under a lock its operators take.
  void Shutdown();

  // Envelopes sent to other hosts and batches they travelled in: batching shows as the ratio.
  int64_t envelopes_sent() const;
  int64_t batches_sent() const;

 private:
  friend class ShardContext;
  struct EpochState {
    std::vector<int> punctuations;    // per incoming edge (index into in_edges)
    std::vector<int64_t> promised;    // messages the punctuations announced
    std::vector<int64_t> received;    // messages that came
    bool input_closed = false;        // sources
    std::map<std::pair<int, int>, int64_t> sent;  // (edge, dst shard) -> messages sent
  };
  struct Shard {
    // The operator is set here, before the shard is shared, so building an engine takes no
    // shard lock (an owner may build one under its own lock that callbacks also take).
    Shard(int node, int shard, std::unique_ptr<Operator> op) : node(node), shard(shard), op(std::move(op)) {}
    const int node;
    const int shard;
    absl::Mutex mu;
    std::unique_ptr<Operator> op ABSL_GUARDED_BY(mu);
    std::map<int64_t, EpochState> epochs ABSL_GUARDED_BY(mu);
    // The most recent epochs this shard finished (at most kRememberedEpochs): a message for one
    // of them is a protocol error. With counted punctuations no message can follow an epoch's
    // end in a correct run, so this only catches bugs and needs no unbounded history.
    absl::flat_hash_set<int64_t> finished ABSL_GUARDED_BY(mu);
    std::deque<int64_t> finished_order ABSL_GUARDED_BY(mu);
  };

  Shard* FindShard(int node, int shard);
  // Source input for a shard (and its end, with `close`), then one flush.
  absl::Status Feed(int node, int shard, int64_t epoch, std::vector<std::string> payloads, bool close);
  EpochState& EpochOf(Shard& s, int64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Handle(const Envelope& e);
  // Finishes the epoch if everything has arrived: OnEpochDone, then punctuations downstream.
  void MaybeFinish(Shard& s, int64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void Emit(int from_node, int src_shard, int64_t epoch, int edge, int dst_shard, bool punctuation, int64_t count,
            std::string payload);
  void Flush();

  std::atomic<bool> stopped_{false};
  bool handles_on_arrival_ = false;
  const std::string host_;
  const std::shared_ptr<const GraphDef> graph_;
  Transport& transport_;
  Executor& executor_;
  absl::flat_hash_map<int64_t, std::unique_ptr<Shard>> shards_;  // key node << 32 | shard; fixed after construction

  mutable absl::Mutex out_mu_;
  std::map<std::string, std::vector<Envelope>> outbox_ ABSL_GUARDED_BY(out_mu_);
  int64_t envelopes_sent_ ABSL_GUARDED_BY(out_mu_) = 0;
  int64_t batches_sent_ ABSL_GUARDED_BY(out_mu_) = 0;
};

// Delivers batches between engines in one process by direct call: no network, no serialisation.
// Thread-safe once every engine is registered.
class LocalTransport : public Transport {
 public:
  void Register(Engine* engine) { engines_[{engine->host(), engine->graph().name()}] = engine; }
  void Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) override;

 private:
  std::map<std::pair<std::string, std::string>, Engine*> engines_;
};

// The engines one owner made, whose operators refer to the owner: it shuts them all down before
// it goes, those it already let go of included (a batch still queued may hold one). Thread-safe.
class OwnedEngines {
 public:
  void Add(const std::shared_ptr<Engine>& engine);
  // Call from the owner's destructor, holding no lock that its operators take.
  void ShutdownAll();

 private:
  absl::Mutex mu_;
  std::vector<std::weak_ptr<Engine>> engines_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::dataflow
