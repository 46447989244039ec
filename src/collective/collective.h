// SPMD collectives between the shards of one gang computation: the runtime half, torch-free.
//
// Every collective is built on one primitive, an exchange: each member of a group (the shards
// that share their coordinates on the mesh axes not named) contributes a byte string and gets
// every member's contribution in group-rank order. The compute layer turns an exchange into
// all_reduce, all_gather, reduce_scatter, all_to_all or broadcast with libtorch kernels, so the
// arithmetic is the same code whether members share a host or not.
//
// Within a host, members meet in a rendezvous in this process's memory: contributions are
// shared, never copied between members. When a group spans hosts, the member that completes
// its host's part (the host's leader for that call) exchanges the host's contributions with the
// other hosts' leaders through Gloo (CrossHostExchange), then wakes its local members.
//
// Waiting is bounded: a member that does not meet the rest of its group within the timeout fails
// with DeadlineExceeded. That is what a deadlock between gangs ordered inconsistently looks like
// (see the island scheduler), and it fails the runs involved instead of hanging the devices.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pathways::collective {

// A key-value store for rendezvous between hosts: Gloo's contexts find each other through it.
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

// Where one shard of a gang runs: its host and the device's cluster-wide id.
struct Member {
  std::string host;
  int32_t device = -1;
};

// A gang's shape: the mesh of its slice and where each shard runs (shard i at members[i],
// row-major over the mesh). Immutable; built once per program node and shared by its runs.
struct GangLayout {
  std::vector<int64_t> mesh_dims;
  std::vector<std::string> axis_names;
  std::vector<Member> members;
};

// The members of one shard's group over some mesh axes.
struct Group {
  std::vector<int64_t> shards;  // in group-rank order: row-major over the named axes, as named
  int rank = 0;                 // the calling shard's rank
  std::string id;               // the coordinates on the other axes, unique within the gang
};

// The group of `shard` over `axes`: comma-separated axis names; empty means every axis.
// InvalidArgument for an unknown or repeated axis name.
absl::StatusOr<Group> GroupOf(const GangLayout& layout, int64_t shard, absl::string_view axes);

// Exchanges one host's contributions with the other hosts of a group. Implemented with Gloo.
class CrossHostExchange {
 public:
  virtual ~CrossHostExchange() = default;
  // `hosts` are the group's distinct hosts in a fixed order (the same on every host), `mine` is
  // this host's index in it, and `member_key` names the set of devices involved (members that
  // share devices reuse one connection). `local` holds this host's contributions, all of
  // `part_bytes` bytes; returns every host's contributions, in `hosts` order, each the
  // concatenation of that host's parts. `tag` is unique per call and equal on every host.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(const std::vector<std::string>& hosts, int mine,
                                                             const std::string& member_key, uint32_t tag,
                                                             const std::string& local, absl::Duration timeout) = 0;
};

// What the members of a group get back: every contribution, in group-rank order.
struct Exchanged {
  std::vector<std::shared_ptr<const std::string>> parts;
  int rank = 0;
};

// One host's meeting point for collectives. Thread-safe; one per host runtime.
class CollectiveHub {
 public:
  // `host` is this host's name as it appears in Member::host. `cross_host` may be null when no
  // group ever spans hosts (a single-host runtime); such a group then fails with Unimplemented.
  CollectiveHub(std::string host, std::unique_ptr<CrossHostExchange> cross_host, absl::Duration timeout);
  const std::string& host() const { return host_; }
  absl::Duration timeout() const { return timeout_; }

  // Blocks until every member of the group has contributed. `call_key` names this call of this
  // gang execution and is the same on every member (for example client/program/run/node/call
  // index/group id).
  absl::StatusOr<Exchanged> Exchange(const GangLayout& layout, const Group& group, const std::string& call_key,
                                     std::string bytes);

 private:
  struct Meeting;
  // Fills the parts of members on other hosts. Runs on the host's last member to arrive.
  absl::Status CompleteAcrossHosts(const GangLayout& layout, const Group& group, const std::string& call_key,
                                   Meeting& meeting);

  const std::string host_;
  const std::unique_ptr<CrossHostExchange> cross_host_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Meeting>> meetings_ ABSL_GUARDED_BY(mu_);
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
  absl::StatusOr<Exchanged> Exchange(absl::string_view axes, std::string bytes);
  // Members of the shard's group over `axes`, for kernels that must know the group size first.
  absl::StatusOr<Group> GroupOver(absl::string_view axes) const { return GroupOf(*layout_, shard_, axes); }
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
  const int64_t shard_;
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
