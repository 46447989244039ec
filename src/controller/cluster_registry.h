// The controller's view of the cluster: islands, hosts, devices, liveness, and slice placement.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/pathways.pb.h"

namespace pathways {

// Thread-safe. Time is passed in, so liveness is testable without waiting.
class ClusterRegistry {
 public:
  explicit ClusterRegistry(absl::Duration heartbeat_timeout) : heartbeat_timeout_(heartbeat_timeout) {}

  // A worker at an address already known re-registers under its old host id (it restarted, or
  // the controller dropped it); its devices are replaced.
  absl::StatusOr<rpc::RegisterWorkerResponse> RegisterWorker(const rpc::RegisterWorkerRequest& r,
                                                             absl::Time now);
  // False when the host is unknown (it must register again).
  bool Heartbeat(const rpc::HeartbeatRequest& r, absl::Time now);
  rpc::ClusterStatus Status(absl::Time now) const;
  // Places a slice of prod(mesh_shape) devices on live hosts (in one island when asked), taking the
  // least-loaded devices first and laying them out host by host so that mesh neighbours share a
  // host where possible.
  absl::StatusOr<rpc::AllocateSliceResponse> AllocateSlice(const rpc::AllocateSliceRequest& r,
                                                           absl::Time now);
  // The island of the live worker at `address`: NotFound for an unknown one, Unavailable for one
  // that stopped heartbeating.
  absl::StatusOr<int32_t> IslandOf(const std::string& address, absl::Time now) const;

 private:
  struct Device {
    rpc::DeviceInfo info;
    int64_t slices = 0;  // slices placed on it so far: the load the placement spreads
  };
  struct Host {
    int32_t host_id;
    int32_t island;
    std::string address;
    absl::Time last_heartbeat;
    std::vector<Device> devices;
  };
  bool AliveLocked(const Host& h, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return now - h.last_heartbeat <= heartbeat_timeout_;
  }

  const absl::Duration heartbeat_timeout_;
  mutable absl::Mutex mu_;
  std::map<int32_t, Host> hosts_ ABSL_GUARDED_BY(mu_);
  int32_t next_host_id_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t next_device_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_slice_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace pathways
