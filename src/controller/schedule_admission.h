// Clients' schedule requests on their way into the island schedulers: checked, split by island,
// and held for a while when they name hosts a controller that restarted has not heard from yet.
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "controller/cluster_registry.h"
#include "controller/run_groups.h"
#include "core/future.h"
#include "proto/pathways.pb.h"

namespace pathways {

// Thread-safe.
class ScheduleAdmission {
 public:
  // Where admitted runs go: a batch of one client's runs within one island, or one run over
  // several islands (a part per island). Each future completes once the hosts have the runs.
  struct Sinks {
    std::function<Future<Unit>(int island, const std::string& client, double weight, std::vector<rpc::GangRun> runs)>
        island;
    std::function<Future<Unit>(const std::string& client, double weight, std::vector<std::pair<int, rpc::GangRun>> parts)>
        across_islands;
    // Checked again before a held request goes: whether the client (of `tenant`) may still
    // schedule. A controller that restarted learns of refused tenants as hosts register, which
    // is while it holds requests.
    std::function<absl::Status(const std::string& client, const std::string& tenant)> still_admitted;
  };
  // Until `hold_until`, a request that names a host not registered yet, or one where the registry
  // does not know the client yet, is held instead of refused (see SubmitOrHold).
  ScheduleAdmission(ClusterRegistry& registry, double max_weight, absl::Time hold_until, Sinks sinks)
      : registry_(registry), max_weight_(max_weight), hold_until_(hold_until), sinks_(std::move(sinks)) {}

  // Checks the request (weight, hosts, the client's right to use them) and hands its runs to
  // their islands' schedulers, in the request's order: complete once every host has its runs.
  // Nothing of a refused request reaches a scheduler, so trying it again is safe: a controller
  // that restarted hears from its hosts again within a heartbeat or two, and meanwhile a live
  // client's request that names them waits (RetryHeld) instead of failing.
  // `tenant`: the named tenant the request's call acted for ("" none), for still_admitted.
  Future<Unit> SubmitOrHold(const rpc::ScheduleRequest& request, const std::string& tenant);
  // Tries the held requests again, in the order they came (a client sends its next once this one
  // is answered); those still refused at `now`, past the hold, are answered with the refusal.
  void RetryHeld(absl::Time now);
  // Refuses every request from now on, and those held.
  void Close();
  // The client went away: its run groups are dropped.
  void ForgetClient(const std::string& client) { groups_.Forget(client); }
  size_t num_held();

  // Held requests at most, in number and in bytes (a request may be 4 MiB): past either a refused
  // request is answered at once.
  static constexpr size_t kMaxHeld = 4096;
  static constexpr size_t kMaxHeldBytes = size_t{64} << 20;

 private:
  absl::StatusOr<std::vector<Future<Unit>>> Submit(const rpc::ScheduleRequest& request, absl::Time now);
  bool MayHold(const absl::Status& refused, absl::Time now) const {
    return (absl::IsNotFound(refused) || absl::IsPermissionDenied(refused)) && now < hold_until_;
  }

  ClusterRegistry& registry_;
  const double max_weight_;
  const absl::Time hold_until_;
  const Sinks sinks_;
  RunGroupBook groups_;
  struct Held {
    rpc::ScheduleRequest request;
    std::string tenant;
    Promise<Unit> promise;
    size_t bytes;
  };
  absl::Mutex mu_;
  std::list<Held> held_ ABSL_GUARDED_BY(mu_);
  size_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> closed_{false};  // set under mu_
};

}  // namespace pathways
