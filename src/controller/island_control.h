// How an island's gang scheduler reaches the island's hosts: the island control graph
// (dataflow/control_graph.h), with the scheduler's shards in the controller.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "controller/island_scheduler.h"
#include "core/executor.h"
#include "dataflow/engine.h"
#include "dataflow/dataflow_service.h"

namespace pathways {

struct IslandControlOptions {
  int island = 0;
  std::string controller;              // this controller's address
  std::string controller_incarnation;  // this controller process's random identity
  dataflow::Transport* transport = nullptr;      // not owned
  dataflow::DataflowService* service = nullptr;  // not owned; the controller's engines register here
  Executor* executor = nullptr;                  // not owned; runs the controller's shards
  // Hands a new generation's graph to a host (the worker's JoinControlGraph). Failures are
  // logged: a host that cannot be told is about to be found gone.
  std::function<Future<Unit>(const std::string& host, const rpc::ControlGraph& graph)> join;
  // What hosts report back: their part of a run is done.
  std::function<void(const rpc::RunDone&)> on_done;
};

// The scheduler's ops travel as rounds: every op pushed between two EndRound calls is one epoch
// of the graph, each to its host's apply shard, and all of a round's futures complete when every
// host the round has ops for has all of it (progress tracking is the acknowledgement; hosts it
// has none for never hear of it, so a round's cost follows its hosts, not the island's). Each
// op carries its place in its host's order, so hosts apply them in order whatever path or
// generation brought them.
//
// SetMembers starts a new generation when the island's live hosts change: a graph naming the
// new set, sent to each of them. Pending rounds that a host which left had not yet accepted fail
// with Unavailable. Every pending round's older generation stays in use until the hosts still
// there have accepted it (its ops to them may be on their way: the new generation names the
// oldest in use, and hosts keep those).
// Thread-safe.
class IslandControlPlane : public ScheduledOpSink {
 public:
  struct Member {
    std::string address;
    std::string incarnation;
    bool operator==(const Member&) const = default;
    bool operator<(const Member& o) const { return std::tie(address, incarnation) < std::tie(o.address, o.incarnation); }
  };

  explicit IslandControlPlane(IslandControlOptions options);
  ~IslandControlPlane() override;  // pending rounds fail with Cancelled

  // The island's live hosts now; a change starts a new generation.
  void SetMembers(std::vector<Member> members);
  // The controller is going: pending rounds fail with Unavailable, and so does every Push from
  // now on, so nothing waits on hosts any more.
  void Stop();
  // Unavailable at once for a host that is not a live member.
  Future<Unit> Push(const std::string& host, rpc::ScheduledOp op) override;
  void EndRound() override;
  // Scheduling rounds sent so far.
  int64_t rounds() const;
  int64_t generation() const;

 private:
  class Accepted;
  class Done;
  struct Round {
    Promise<Unit> accepted;
    std::set<std::string> hosts;  // that it carries ops for and that have not accepted it yet
    bool settled = false;         // `accepted` was failed already: a host it carried ops for left
  };
  struct Generation {
    rpc::ControlGraph def;
    std::shared_ptr<dataflow::Engine> engine;
    std::map<std::string, int32_t> shard_of;  // host address -> its shard
    std::map<int64_t, Round> pending;         // rounds not yet accepted by every host
  };
  // The host at `host_shard` of generation `number` has all of the round; once every host the
  // round has ops for has, it is accepted.
  void HostAccepted(int64_t number, int64_t round, int32_t host_shard);
  Generation* CurrentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the open round, if it has ops.
  void CloseRoundLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Generations other than the current one that have nothing pending any more go.
  void DropIdleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const IslandControlOptions options_;
  dataflow::OwnedEngines engines_;
  mutable absl::Mutex mu_;
  std::vector<Member> members_ ABSL_GUARDED_BY(mu_);  // sorted
  std::map<int64_t, std::unique_ptr<Generation>> generations_ ABSL_GUARDED_BY(mu_);
  int64_t current_ ABSL_GUARDED_BY(mu_) = 0;  // the generation new rounds go to; 0: none (no live hosts)
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t round_ ABSL_GUARDED_BY(mu_) = 1;  // the open round; rounds are numbered across generations
  std::vector<std::string> open_ ABSL_GUARDED_BY(mu_);  // the open round's ops, encoded
  // Per host: the incarnation its order numbers belong to, and the last number given.
  std::map<std::string, std::pair<std::string, int64_t>> orders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
