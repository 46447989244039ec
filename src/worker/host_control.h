// A host's side of its island's control graphs (dataflow/control_graph.h): the scheduler's ops
// come in through them, in the island's order, and reports go back.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/executor.h"
#include "dataflow/engine.h"
#include "dataflow/dataflow_service.h"
#include "proto/pathways.pb.h"

namespace pathways {

struct HostControlOptions {
  std::string host;                              // this host's address
  dataflow::DataflowService* service = nullptr;  // not owned
  dataflow::Transport* transport = nullptr;      // not owned
  Executor* executor = nullptr;                  // not owned
  // Applies scheduled ops, called in the island's order (one call at a time).
  std::function<absl::Status(std::vector<rpc::ScheduledOp>)> apply;
  // How long ops may wait for an earlier one that has not come before the order counts as lost
  // (Broken): it comes in milliseconds, through one graph or another, unless it was lost.
  absl::Duration early_wait = absl::Seconds(60);
};

// Ops carry their place in this host's order (ScheduledOp.order, counted per controller
// incarnation); ops that come early wait here for those before them, so the order holds
// whichever generation's graph or path brought them. Thread-safe.
class HostControl {
 public:
  // At most this many generations of one controller are kept, whatever the controller says is
  // still in use (ControlGraph.oldest_generation): a bound against a controller gone wrong.
  static constexpr size_t kMaxGenerations = 64;

  explicit HostControl(HostControlOptions options);
  ~HostControl();  // leaves every graph

  // Joins a generation of its island's control graph. InvalidArgument when the graph is
  // malformed or does not name this host. Joining one already joined does nothing. A newer
  // controller incarnation starts the order afresh.
  absl::Status Join(const rpc::ControlGraph& graph);
  // Reports to the controller through the newest graph joined. Dropped (logged) before any.
  void ReportDone(rpc::RunDone done);
  // Leaves every graph; later messages are dropped. Call before what `apply` uses goes away.
  void Shutdown();
  // The graphs this host is in now.
  size_t num_generations();
  // Unavailable, saying why, once the island's order cannot go on here: a scheduled op that could
  // not be read (its place in the order is unknown, so every later op would wait for it), a
  // generation that lost batches from its hosts before this host joined it (the same, for the ops
  // they held), or ops that waited for one that never came, more than kMaxEarlyOps of them or for
  // longer than `early_wait` (asking is what judges the time: the worker asks at each heartbeat).
  // The host must then leave (the worker tells the controller, which fails its runs); until then
  // ops are still taken in order.
  // A new controller incarnation starts a new order, and clears it.
  absl::Status Broken();
  // Ops kept waiting for an earlier one, at most.
  static constexpr size_t kMaxEarlyOps = 1 << 16;

  // For tests: what the apply shard of a generation of `controller_incarnation` hands over.
  void TEST_OnScheduled(const std::string& controller_incarnation, const std::string& bytes) {
    OnScheduled(controller_incarnation, bytes);
  }

 private:
  class Apply;
  struct Generation {
    rpc::ControlGraph def;
    int32_t shard;
    std::shared_ptr<dataflow::Engine> engine;
  };
  // Leaves every graph, dropping ops that wait for earlier ones.
  void LeaveAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An op from the apply shard of a generation of `controller_incarnation`.
  void OnScheduled(const std::string& controller_incarnation, const std::string& bytes);

  const HostControlOptions options_;
  dataflow::OwnedEngines engines_;
  absl::Mutex mu_;
  std::string controller_incarnation_ ABSL_GUARDED_BY(mu_);
  std::deque<Generation> generations_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t next_order_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t oldest_generation_ ABSL_GUARDED_BY(mu_) = 0;  // older graphs are out of use
  std::map<int64_t, rpc::ScheduledOp> early_ ABSL_GUARDED_BY(mu_);
  absl::Time early_since_ ABSL_GUARDED_BY(mu_);  // since when early_ waits for next_order_
  int64_t next_report_epoch_ ABSL_GUARDED_BY(mu_) = 1;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // see Broken()
  // The island's order cannot go on here, for `why` (the first reason stands).
  void BreakLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace pathways
