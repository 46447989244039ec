// The controller's view of the cluster: islands, hosts, devices, liveness, and slice placement.
#pragma once

#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "controller/stall_credit.h"
#include "core/ids.h"
#include "proto/pathways.pb.h"

namespace pathways {

// Thread-safe. Time is passed in, so liveness is testable without waiting.
class ClusterRegistry {
 public:
  explicit ClusterRegistry(absl::Duration heartbeat_timeout)
      : heartbeat_timeout_(heartbeat_timeout), stall_(heartbeat_timeout) {}

  // The controller's liveness loop woke at `now` (every 100 ms or so). If it was away past a
  // quarter of the heartbeat timeout (the controller frozen or starved), every host is credited
  // with the time it was away: hosts are judged by what they sent while it could listen. Until
  // this is first called, nothing is credited (tests pass times in freely).
  void Awake(absl::Time now);

  // A worker at an address already known re-registers under its old host id (it restarted, or
  // the controller dropped it); its devices are replaced.
  absl::StatusOr<rpc::RegisterWorkerResponse> RegisterWorker(const rpc::RegisterWorkerRequest& r,
                                                             absl::Time now);
  // kUnknown: the host is not registered here (a restarted controller): it registers again.
  // kExpired: it was silent past the heartbeat timeout, so it was already treated as gone (its
  // runs failed, its island went on without it); it is not revived and must leave.
  // kLeft: the registered process said it leaves, and why (HeartbeatRequest.leaving, kept up to
  // kMaxLeaveReason bytes); it is departed from now on. Said once: later beats are kExpired.
  enum class Beat { kAlive, kUnknown, kExpired, kLeft };
  static constexpr size_t kMaxLeaveReason = 1024;  // it reaches clients
  Beat Heartbeat(const rpc::HeartbeatRequest& r, absl::Time now);
  // Why the registered process that sent `r` left or was made to leave; empty when it was only
  // silent past the timeout (or is unknown).
  std::string WhyLeft(const rpc::HeartbeatRequest& r) const;
  // The live host that sent `reporter` could not deliver dataflow batches to the hosts it names
  // (HeartbeatRequest.unreachable). Runs between them would wait for good, so one side leaves,
  // as a silent host does: the one peer named, unless the reporter names two or more live peers,
  // or already made another host leave this way within kCutOffWindow; then the reporter itself
  // is the one cut off, and it alone leaves (a host that reaches nobody makes at most one other
  // leave). Returns the addresses made to leave; none when no live peer other than the reporter
  // is named, or the reporter is not live.
  static constexpr absl::Duration kCutOffWindow = absl::Minutes(1);
  std::vector<std::string> ReportUnreachable(const rpc::HeartbeatRequest& reporter, absl::Time now);
  rpc::ClusterStatus Status(absl::Time now) const;
  // Each device's work (as its heartbeats reported it, in buckets) that ended within `window`
  // before `now`. What is kept per device is bounded whatever workers send: the buckets of the
  // last kTimelineKept, at most kMaxTimelineBuckets of them, each at most kMaxBucketWidth wide
  // with at most kMaxBucketClients clients; a heartbeat adds at most kMaxBucketsPerBeat per device.
  static constexpr absl::Duration kTimelineKept = absl::Seconds(30);
  static constexpr size_t kMaxTimelineBuckets = 1024;
  static constexpr int kMaxBucketsPerBeat = 256;
  static constexpr absl::Duration kMaxBucketWidth = absl::Seconds(10);
  static constexpr int kMaxBucketClients = 8;
  // What is kept of a heartbeat's HostCounters: a latency histogram of at most this many bounds
  // (else none), and failures of at most this many client labels (a worker's 256 and "other").
  static constexpr int kMaxLatencyBounds = 64;
  static constexpr int kMaxFailureLabels = 257;
  rpc::ClusterTimeline Timeline(absl::Time now, absl::Duration window) const;
  // Places a slice of prod(mesh_shape) devices on live hosts (in one island when asked), taking the
  // least-loaded devices first and laying them out host by host so that mesh neighbours share a
  // host where possible.
  absl::StatusOr<rpc::AllocateSliceResponse> AllocateSlice(const rpc::AllocateSliceRequest& r,
                                                           absl::Time now);
  // The client's slices, each lost when a device it was placed on is gone (its host stopped
  // heartbeating, or re-registered with new devices).
  rpc::SliceStatesResponse SliceStates(const std::string& client_id, absl::Time now) const;
  // Places one of the client's slices again, with the constraints it was created with, on live
  // devices (spreading load as AllocateSlice does). NotFound for a slice the client does not own.
  absl::StatusOr<rpc::AllocateSliceResponse> RemapSlice(const rpc::RemapSliceRequest& r, absl::Time now);
  // Registered hosts that stopped heartbeating, or left: address, and why when known beyond the
  // silence (Host::left).
  struct Departed {
    std::string address;
    std::string why;
    friend bool operator==(const Departed&, const Departed&) = default;
  };
  std::vector<Departed> DepartedHosts(absl::Time now) const;
  struct LiveHost {
    int32_t island;
    std::string address;
    std::string incarnation;
  };
  // Every host heartbeating now.
  std::vector<LiveHost> LiveHosts(absl::Time now) const;
  // The island of the live worker at `address`: NotFound for an unknown one, Unavailable for one
  // that stopped heartbeating.
  absl::StatusOr<int32_t> IslandOf(const std::string& address, absl::Time now) const;

  // Whether the client may name the host at `address` in a run it schedules: a host of some
  // mapping of one of its slices (every mapping ever made: arrays placed under an old one still
  // live there), or one that said it holds the client's data when it registered (after a
  // controller restart, the hosts of slices the previous controller placed). PermissionDenied
  // otherwise: a tenant runs work only on hosts it was given devices of. Devices are shared, not
  // leased exclusively (placement spreads load), so this keeps a tenant off hosts it was never
  // placed on; it does not reserve a host for one tenant. After a controller restart, a host of
  // a client's slice that held none of its data is refused until the client makes a slice there.
  absl::Status CheckClientMayUse(const std::string& client_id, const std::string& address) const;
  void NoteClientOnHost(const std::string& client_id, const std::string& address);
  // A departed client's slices and hosts are forgotten; the devices it loaded are free of it.
  void ForgetClient(const std::string& client_id);

 private:
  struct Placed {
    HostId host_id;
    DeviceId device_id;
    std::string incarnation;  // of the host when placed
  };
  struct Slice {
    rpc::AllocateSliceRequest request;
    std::vector<Placed> devices;
  };
  struct Device {
    rpc::DeviceInfo info;
    int64_t slices = 0;  // slices placed on it so far: the load the placement spreads
    std::deque<rpc::WorkBucket> recent_work;  // by start, oldest first
  };
  struct Host {
    HostId host_id;
    int32_t island;
    int32_t island_rank;  // hosts of an island are numbered as they first register
    std::string address;
    std::string incarnation;
    absl::Time last_heartbeat;
    std::vector<Device> devices;
    rpc::HostCounters counters;  // as of the last heartbeat
    std::string left;  // why it left the cluster, as it said (a device stuck); empty while it serves
    absl::Time made_leave = absl::InfinitePast();  // when it last made a host it could not reach leave
  };
  // The registered process that sent `r` (its id, address and incarnation); null when none.
  const Host* SenderLocked(const rpc::HeartbeatRequest& r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chooses devices for a slice request; fills `response` and records the slice as `slice_id`.
  absl::Status PlaceLocked(const rpc::AllocateSliceRequest& r, SliceId slice_id, absl::Time now,
                           rpc::AllocateSliceResponse& response) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The devices a slice was placed on carry one slice less (it moved, or its client went).
  void ReleaseLocked(const Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the slice has lost devices; empty when it has not.
  std::string LostReasonLocked(const Slice& s, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Silent past the timeout, not counting a time the controller itself was away and has not
  // yet credited (StallCredit).
  bool SilentLocked(const Host& h, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return now - h.last_heartbeat - stall_.Away(now) > heartbeat_timeout_;
  }
  bool AliveLocked(const Host& h, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return h.left.empty() && !SilentLocked(h, now);
  }

  const absl::Duration heartbeat_timeout_;
  mutable absl::Mutex mu_;
  StallCredit stall_ ABSL_GUARDED_BY(mu_);
  std::map<HostId, Host> hosts_ ABSL_GUARDED_BY(mu_);
  HostId next_host_id_ ABSL_GUARDED_BY(mu_){0};
  DeviceId next_device_id_ ABSL_GUARDED_BY(mu_){0};
  SliceId next_slice_id_ ABSL_GUARDED_BY(mu_){1};
  std::map<SliceId, Slice> slices_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<std::string>> client_hosts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
