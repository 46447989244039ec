// The controller's side of run groups (rpc::GangRun.group): a client's runs over one set of
// hosts name those hosts and their places once per epoch, and after that only the group, the
// epoch and the run's number in it. Here each such run gets its hosts back before admission,
// so everything after (admission, island schedulers, hosts) sees whole runs.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/pathways.pb.h"

namespace pathways {

// Thread-safe. One client's requests come one at a time (it sends its next once this one is
// answered), which is the order the epochs' runs are checked in.
class RunGroupBook {
 public:
  // Names every host of every run in `request` that does not: the run after run k of an epoch
  // takes the place after run k's on each host. A run that names its hosts starts or restates
  // its group's epoch. Aborted (IsRunGroupOutOfStep) when a run that names no host is
  // not the next of an epoch known here (this controller restarted, an earlier request was lost,
  // the group was forgotten to stay within bounds); then nothing is recorded and nothing of the
  // request may be scheduled, so the client may send it again naming its epochs' hosts.
  absl::Status Resolve(rpc::ScheduleRequest& request);
  // The client went away: what it had is dropped.
  void Forget(const std::string& client);

  // Groups kept per client, and bytes of kept groups over all clients (their host names and
  // places): past either the least recently used group goes (its next run is then out of step,
  // and comes again naming its hosts). A hostile client can so make others name their hosts
  // again, not make the controller hold more.
  static constexpr size_t kMaxGroupsPerClient = 256;
  static constexpr size_t kMaxBytesKept = size_t{64} << 20;
  static constexpr size_t kHostOverheadBytes = 64;  // a kept host besides its name
  // Hosts named in one request for runs that named only their group, at most: a small request
  // of many runs over a large group must not become a huge one here (InvalidArgument). A client
  // cuts its requests at 1 MiB counting each run as if it named its hosts, far below this.
  static constexpr size_t kMaxHostsNamedPerRequest = size_t{1} << 18;
  size_t bytes_kept();

 private:
  using Lru = std::list<std::pair<std::string, int64_t>>;  // (client, group), most recent first
  struct Epoch {
    int64_t epoch = 0;
    int64_t last_run = 0;
    // Each host's place as run 0 of the epoch would have it (a run k that named them, minus k).
    // Immutable once made, shared by the copies Resolve works on: a request copies no host.
    std::shared_ptr<const std::vector<rpc::HostSeq>> base;
    size_t bytes = 0;
    Lru::iterator lru;
    uint64_t used = 0;  // clock_ when last touched
  };
  using Groups = absl::flat_hash_map<int64_t, Epoch>;
  void ForgetLocked(const std::string& client, int64_t group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Groups> clients_ ABSL_GUARDED_BY(mu_);
  Lru lru_ ABSL_GUARDED_BY(mu_);
  size_t bytes_kept_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
