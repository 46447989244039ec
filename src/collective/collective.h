// SPMD collectives between the shards of one gang computation: the runtime half, torch-free.
//
// The runtime offers all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and roll over
// a group: the shards that share their coordinates on the mesh axes not named. The compute layer
// hands each call's contiguous input and output buffers here (no copies through strings); the
// arithmetic of reductions is done here on raw buffers (reduction.h), in place in the output.
//
// Within a host, members meet in this process's memory and share their buffers. When a group
// spans hosts, the host's leader for the call runs a cross-host algorithm chosen by size
// (cross_host.h) over persistent connections between the group's hosts (peer_mesh.h).
//
// Waiting is bounded: a member that does not meet the rest of its group within the timeout fails
// with DeadlineExceeded. That is what a deadlock between gangs ordered inconsistently looks like
// (see the island scheduler), and it fails the runs involved instead of hanging the devices.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "collective/group.h"
#include "collective/reduction.h"
#include "core/types.h"

namespace pathways::collective {

// A key-value store for rendezvous between hosts: their collective endpoints find each other
// through it.
// Thread-safe.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual absl::Status Set(const std::string& key, std::string value) = 0;
  // Waits until `key` is set; DeadlineExceeded after `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
};

// The store for hosts in one process (tests, LocalCluster without a controller). Thread-safe.
class InMemoryKeyValueStore : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, std::string value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

class TcpLinks;
struct CallId;
struct Withdrawal;

enum class CollectiveKind { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast, kRoll };
const char* CollectiveName(CollectiveKind kind);

// One member's part of a collective. The buffers are the member's and stay valid until the call
// returns; `in` and `out` do not overlap, except that an all_reduce may be given the same buffer
// for both (it then reduces in place). With G members in the group, `out` holds `count`
// elements, except for all_gather (G * count: every member's input in rank order) and
// reduce_scatter (count / G: the caller's chunk of the reduction). reduce_scatter and all_to_all
// split `in` into G equal chunks, chunk j for member j. roll is a point-to-point exchange: member
// r gets member (r - shift) mod G's input, as torch.roll moves elements (a ring shift: what a
// stencil's halo or a pipeline's next stage needs). Collectives that only move data may be given
// any data as bytes (kBool elements).
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;  // all_reduce, reduce_scatter
  int root = 0;                  // broadcast: the group rank whose input everyone gets
  size_t count = 0;
  const char* in = nullptr;
  char* out = nullptr;
  int64_t shift = 0;  // roll: by how many ranks the inputs move (any sign)
};

// One host's meeting point for collectives. Thread-safe; one per host runtime.
//
// Members on this host meet in memory: the last to arrive (the host's leader for that call)
// combines their inputs in place (reduces them into one buffer, or lays them side by side),
// runs the cross-host part with the other hosts' leaders (cross_host.h), and writes every local
// member's output, while the others wait. A group on one host never touches a socket.
class CollectiveHub {
 public:
  // `host` is this host's name as it appears in Member::host. `links` may be null when no
  // group ever spans hosts (a single-host runtime); such a group then fails with Unimplemented.
  CollectiveHub(std::string host, std::shared_ptr<TcpLinks> links, absl::Duration timeout);
  ~CollectiveHub();
  // The host is going: members waiting for others on this host, or for other hosts to connect,
  // stop waiting (Cancelled), and later calls fail at once. A cross-host exchange on connected
  // links ends by its own deadline.
  void Shutdown();
  const std::string& host() const { return host_; }
  absl::Duration timeout() const { return timeout_; }

  // Blocks until every member of the group has called and this member's output is written.
  // `call_key` names this call of this gang execution and is the same on every member (for
  // example client/program/run/node/call index/group id). Members that disagree on the call
  // fail with InvalidArgument; members that do not all arrive within the timeout fail with
  // DeadlineExceeded; errors name the collective.
  // `id` names the same call for the messages between hosts. `execution` is the gang execution
  // the call belongs to (ShardCollectives::ExecutionKey), for Withdraw.
  absl::Status Run(const GroupPlacement& placement, const std::string& execution, const std::string& call_key,
                   const CallId& id, const CollectiveCall& call);

  // Shard `shard` of gang execution `execution` (of gang `layout`) makes no more calls after the
  // `calls` it made: it failed (`why`) before its body ran (an input that failed, memory it could
  // not get) or while it ran. Its group mates on this host stop waiting for it: a meeting of that
  // execution that waits for it fails at once, now or when they come to it, with why (a member
  // that failed alone would otherwise hold its mates, and every later gang on their devices,
  // until the timeout). When the group spans hosts, the mate that finds the meeting failed tells
  // the other hosts, as a failed call is told. A group whose members on this host have all
  // withdrawn has no mate here to tell: its other hosts, once they have waited for this one a
  // while, ask it (TcpLinks::Withdrew, AskWithdrawn) and fail with why (groups over any subset of
  // the mesh's axes, for meshes of up to 6 axes; over every axis beyond). Remembered here for
  // twice the timeout (at most kMaxWithdrawals executions).
  void Withdraw(const std::shared_ptr<const GangLayout>& layout, const std::string& execution, int64_t shard, int calls,
                const absl::Status& why);

  // Client `client` went away (its host collected it, at the point of the island's order where
  // every host of its runs does): its runs' results are dropped, so its collectives here stop
  // waiting for anyone. A call of its executions that waits (for a mate on this host, to connect
  // to a peer host, or for a peer's message) fails with `why` within PeerMesh::kCheckPeersMs, and
  // later calls fail at once, for twice the timeout. Otherwise a host holding its part of a run
  // whose other hosts never started it (its program never reached them before the client went)
  // would hold its devices, and every other client's gangs on them, until the timeout. Other
  // clients' calls are untouched.
  void ClientGone(const std::string& client, const absl::Status& why);  // why: not OK

  // Client `client`'s run `run` of program `program` failed on this host before any of its shards
  // here was set up (its program never reached this host, or failed to register): this host makes
  // none of its collective calls, and its other hosts' members, which do not know that, are told
  // when they ask and their messages are dropped here (TcpLinks::RunNotStarted). A shard that
  // fails after it was set up withdraws instead (Withdraw).
  void RunNotStarted(const std::string& client, int64_t program, int64_t run, const absl::Status& why);

  // The group of `shard` of `layout` over `axes`, placed from this host (PlaceGroup) once and
  // kept while the layout is in use elsewhere: a chain runs an execution per node and step, each
  // asking for the same groups, and a group's placement names every member's device (a 16-host
  // stencil spent 5% of its CPU placing groups again).
  absl::StatusOr<std::shared_ptr<const GroupPlacement>> Placed(const std::shared_ptr<const GangLayout>& layout,
                                                               int64_t shard, absl::string_view axes);

  // Every member call's latency (Run's, waiting for the group included) lands in the first
  // bucket whose bound (microseconds) is not below it, or in the last, beyond every bound.
  static constexpr double kLatencyBoundsUs[] = {50,    100,   250,    500,    1000,   2500,    5000,
                                                10000, 25000, 50000, 100000, 250000, 1000000, 10000000};
  static constexpr size_t kLatencyBuckets = std::size(kLatencyBoundsUs) + 1;
  // Member calls since the hub was made, those that failed among them, and their latencies.
  struct Stats {
    int64_t calls = 0;
    int64_t failed = 0;
    std::array<int64_t, kLatencyBuckets> latency_buckets{};
    int64_t latency_sum_us = 0;
    int64_t in_progress = 0;  // member calls inside Run now
    int64_t meetings = 0;     // calls whose members on this host the hub holds a meeting for
  };
  Stats stats() const;

 private:
  struct Meeting;
  // Runs parts 0..n-1 of some work, sharing them with the local members waiting for the leader
  // (or alone, when there are none); the first part's error.
  using Share = absl::FunctionRef<absl::Status(int n, absl::FunctionRef<absl::Status(int)> part)>;
  absl::Status Meet(const GroupPlacement& placement, const std::string& execution, const std::string& call_key,
                    const CallId& id, const CollectiveCall& call);
  // The failure of `meeting` when one of this host's members that has not come to it withdrew;
  // OK when none did.
  absl::Status WithdrawnLocked(const Meeting& meeting) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How many of this host's members withdrew without coming to `meeting`.
  int WithdrawnAwayLocked(const Meeting& meeting) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetWithdrawalsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the calls named `key` (an execution, or a call key that begins with one: the client's id
  // comes first, up to a '/') end: their client went away (ClientGone). OK otherwise.
  absl::Status GoneStatus(absl::string_view key);
  void ForgetGoneLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(gone_mu_);
  // One of a withdrawing shard's groups that span hosts (Withdraw): its axes and id, its members
  // on this host, and, once they have all withdrawn, the first call this host will not make in it
  // and why.
  struct GroupAcross {
    std::string axes;
    std::string group_id;
    std::vector<int64_t> here;
    bool unattended = false;
    uint32_t from_call = 0;
    absl::Status why;
  };

  // The groups of `shard` (of `layout`, seen from `host`) that span hosts: over each subset of
  // the mesh's axes, or only over every axis beyond 6 axes or when they are unnamed.
  static std::vector<GroupAcross> GroupsAcrossHosts(const GangLayout& layout, int64_t shard, const std::string& host);
  // Marks those of `groups` whose members here have all withdrawn from `execution`, with what this
  // host answers their other hosts when they ask.
  void MarkUnattendedLocked(std::vector<GroupAcross>& groups, const std::string& execution)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ShareOut(Meeting& meeting, int n, absl::FunctionRef<absl::Status(int)> part);
  // Combines the local members' calls and runs the cross-host part. Runs on the leader, which
  // shares the copies and reductions of large calls out among the local members.
  absl::Status Perform(const GroupPlacement& placement, const std::string& call_key, const CallId& id,
                       const std::vector<const CollectiveCall*>& calls, Share share);

  const std::string host_;
  const std::shared_ptr<TcpLinks> links_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Meeting>> meetings_ ABSL_GUARDED_BY(mu_);
  // Meetings that ended with members missing (timed out, or their client went away), by when: a
  // member that never comes (its body took another branch) would keep one forever; they go after
  // twice the timeout.
  std::deque<std::pair<absl::Time, std::string>> timed_out_ ABSL_GUARDED_BY(mu_);
  // Clients that went away (ClientGone), with why, for twice the timeout (at most kMaxGone, the
  // oldest forgotten first); gone_count_ lets calls skip the lock while there are none.
  static constexpr size_t kMaxGone = 1024;
  absl::Mutex gone_mu_;
  absl::flat_hash_map<std::string, absl::Status> gone_ ABSL_GUARDED_BY(gone_mu_);
  std::deque<std::pair<absl::Time, std::string>> gone_order_ ABSL_GUARDED_BY(gone_mu_);
  std::atomic<int> gone_count_{0};
  // Shards that withdrew, with why, by execution; and the executions in the order they came.
  static constexpr size_t kMaxWithdrawals = 4096;
  struct Withdrawn {
    absl::Status why;
    int calls;  // the collective calls it made first
  };
  absl::flat_hash_map<std::string, absl::flat_hash_map<int64_t, Withdrawn>> withdrawn_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<absl::Time, std::string>> withdrawn_order_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Placed's groups by layout, then by shard and axes, each layout kept alive while it has an
  // entry (so that its address names no other layout meanwhile). Past kMaxPlaced groups, the
  // layouts held nowhere else go first, then every one.
  static constexpr size_t kMaxPlaced = 4096;
  struct PlacedGang {
    std::shared_ptr<const GangLayout> layout;
    absl::flat_hash_map<std::pair<int64_t, std::string>, std::shared_ptr<const GroupPlacement>> groups;
  };
  absl::Mutex placed_mu_;
  absl::flat_hash_map<const GangLayout*, PlacedGang> placed_ ABSL_GUARDED_BY(placed_mu_);
  size_t placed_groups_ ABSL_GUARDED_BY(placed_mu_) = 0;
  std::atomic<int64_t> ok_{0}, failed_{0}, latency_sum_us_{0};  // member calls that succeeded, failed
  std::atomic<int64_t> in_progress_{0};
  std::array<std::atomic<int64_t>, kLatencyBuckets> latency_buckets_{};
};

// What one running shard of a gang computation uses for its collectives. Not thread-safe: it
// belongs to the device thread running the shard, which installs it with ScopedShardCollectives
// so that kernels find it without it passing through the compute interfaces.
class ShardCollectives {
 public:
  // Names one execution of a gang: unique per (client, program, run, node). `client` must outlive
  // the ShardCollectives. The key is only spelled out if the body calls a collective, so shards
  // of bodies without any pay nothing for it.
  struct Execution {
    const std::string* client;
    int64_t program;
    int64_t run;
    int32_t node;
  };
  ShardCollectives(CollectiveHub& hub, std::shared_ptr<const GangLayout> layout, Execution execution, int64_t shard);
  // "client/program/run/node": how the hub names the execution (CollectiveHub::Withdraw).
  static std::string ExecutionKey(const Execution& execution);
  // The run's tag in its calls (CallId::run), the same for every node and group of the run.
  static uint64_t RunTag(const std::string& client, int64_t program, int64_t run);
  // Runs one collective over the shard's group on `axes` (comma-separated mesh axis names; empty
  // means every axis).
  absl::Status Run(absl::string_view axes, const CollectiveCall& call);
  // The number of members of the shard's group over `axes`, for kernels that size their output.
  absl::StatusOr<int> GroupSize(absl::string_view axes);
  // The shard's group over `axes` (its rank: the shard's position along them, row-major as
  // named), without placing it on hosts: for kernels that need where their shard sits in the
  // global array (random numbers).
  absl::StatusOr<Group> GroupOver(absl::string_view axes) const { return GroupOf(*layout_, shard_, axes); }
  // The gang's mesh axis names, in mesh order.
  const std::vector<std::string>& axis_names() const { return layout_->axis_names; }
  // The gang's mesh and members.
  const std::shared_ptr<const GangLayout>& layout() const { return layout_; }
  // Which shard of the gang's arrays this is (its device's place in the slice, row-major).
  int64_t shard() const { return shard_; }
  // The collective calls this shard made (or tried) so far.
  int calls() const { return calls_; }
  // The first error a collective of this shard returned: kernels report failures by throwing,
  // and the compute layer turns the exception back into this Status (keeping its code).
  const absl::Status& first_error() const { return first_error_; }

  // The shard running on this thread, or null outside gang computations.
  static ShardCollectives* Current();

 private:
  friend class ScopedShardCollectives;
  CollectiveHub& hub_;
  const std::shared_ptr<const GangLayout> layout_;
  const Execution execution_;
  std::string execution_key_;  // spelled out at the first collective
  uint64_t run_tag_ = 0;       // RunTag, worked out with the key
  const int64_t shard_;
  // The shard's groups by axes, placed once per execution (a fused loop calls many times).
  absl::StatusOr<const GroupPlacement*> PlacementFor(absl::string_view axes);
  std::vector<std::pair<std::string, std::shared_ptr<const GroupPlacement>>> groups_;
  int calls_ = 0;
  absl::Status first_error_;
};

// Makes `shard` the current thread's ShardCollectives for the scope's lifetime.
class ScopedShardCollectives {
 public:
  explicit ScopedShardCollectives(ShardCollectives* shard);
  ~ScopedShardCollectives();
  ScopedShardCollectives(const ScopedShardCollectives&) = delete;
  ScopedShardCollectives& operator=(const ScopedShardCollectives&) = delete;

 private:
  ShardCollectives* previous_;
};

}  // namespace pathways::collective
