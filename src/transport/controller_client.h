// Blocking calls to the controller. Thread-safe.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/future.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/auth.h"
#include "transport/schedule_stream.h"

namespace pathways {

// Why a controller refuses a schedule request when a run in it that names only its run group
// (rpc::GangRun.group) does not follow a run the controller knows: then nothing of the request
// was scheduled, and it is taken sent again with every run naming its hosts.
inline constexpr char kRunGroupOutOfStep[] = "run group out of step";
bool IsRunGroupOutOfStep(const absl::Status& status);

class ControllerClient {
 public:
  // Calls and the schedule stream show `token` when given, else the process's token (TokenOr,
  // at each call).
  explicit ControllerClient(std::string address, std::optional<std::string> token = std::nullopt);
  ~ControllerClient();  // waits for a schedule stream being made
  const std::string& address() const { return address_; }

  absl::StatusOr<rpc::RegisterWorkerResponse> RegisterWorker(const rpc::RegisterWorkerRequest& r);
  absl::StatusOr<rpc::HeartbeatResponse> Heartbeat(const rpc::HeartbeatRequest& r);
  // With the devices' work of the last `timeline` (ClusterStatus.timeline) when it is not zero.
  absl::StatusOr<rpc::ClusterStatus> GetStatus(absl::Duration timeline = absl::ZeroDuration());
  absl::StatusOr<rpc::AllocateSliceResponse> AllocateSlice(const rpc::AllocateSliceRequest& r);
  absl::StatusOr<rpc::SliceStatesResponse> SliceStates(const rpc::SliceStatesRequest& r);
  // The same without blocking, for code that runs on callback threads (an error being explained).
  Future<rpc::SliceStatesResponse> SliceStatesAsync(const rpc::SliceStatesRequest& r);
  absl::StatusOr<rpc::AllocateSliceResponse> RemapSlice(const rpc::RemapSliceRequest& r);
  // Submits runs to island schedulers; completes once their hosts have them. Asynchronous. One
  // request at a time (the next once this one is answered): requests may go different ways.
  // A request gRPC could not send, having no connection to the controller (it restarts, say), is
  // sent again once the controller answers, up to kReconnectWait after it was asked; one that may
  // have reached the controller is never sent twice. Keep the client until the future is ready.
  // Taken by value: kept (moved, not copied) in case it must be sent again.
  Future<Unit> Schedule(rpc::ScheduleRequest r);
  static constexpr absl::Duration kReconnectWait = absl::Seconds(15);
  // From now on Schedule requests go over a plain TCP stream to the controller's stream listener
  // (transport/schedule_stream.h) when it has one, else (TLS is on, no stream could be made) as
  // unary calls. A stream that breaks is made again for the next request.
  void PreferScheduleStream();
  // Schedule requests sent so far over the schedule stream, and as unary calls (no stream yet,
  // TLS, or the stream was refused: see PreferScheduleStream).
  struct ScheduleCounts {
    int64_t streamed = 0, unary = 0;
  };
  ScheduleCounts schedule_counts() const { return {schedules_streamed_.load(), schedules_unary_.load()}; }
  // Renews the client's lease (or ends it, with `goodbye`); returns the interval to renew at.
  absl::StatusOr<absl::Duration> ClientHeartbeat(const ClientIdentity& client, bool goodbye);
  absl::Status RendezvousSet(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> RendezvousGet(const std::string& key, absl::Duration timeout);

 private:
  // The stream to use now; null: a unary call. Starts making one in the background when there
  // is none (or it broke) and none is being made; never waits on the network itself.
  std::shared_ptr<ScheduleStream> CurrentScheduleStream();
  // The connector thread: makes a stream each time one is wanted (connecting_), until stopping_.
  void ConnectorLoop();
  void ConnectScheduleStream();
  // A Schedule as a unary call; see Schedule for one gRPC could not send.
  Future<Unit> UnarySchedule(std::shared_ptr<const rpc::ScheduleRequest> r, absl::Time asked);
  // Completes once the controller answers a call (gRPC's wait for a connection), or fails after
  // `wait`.
  Future<Unit> WhenReachable(absl::Duration wait);

  const std::string address_;
  const std::optional<std::string> token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::Controller::Stub> stub_;
  std::unique_ptr<rpc::Dataflow::Stub> dataflow_stub_;  // StreamPort
  std::atomic<int64_t> schedules_streamed_{0}, schedules_unary_{0};
  absl::Mutex stream_mu_;
  bool prefer_stream_ ABSL_GUARDED_BY(stream_mu_) = false;
  bool no_stream_ ABSL_GUARDED_BY(stream_mu_) = false;  // the controller offers none: unary for good
  std::shared_ptr<ScheduleStream> stream_ ABSL_GUARDED_BY(stream_mu_);
  static constexpr size_t kRetired = 8;
  std::vector<std::shared_ptr<ScheduleStream>> retired_ ABSL_GUARDED_BY(stream_mu_);  // broken ones
  std::thread connector_ ABSL_GUARDED_BY(stream_mu_);
  bool connecting_ ABSL_GUARDED_BY(stream_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(stream_mu_) = false;
  absl::Time retry_stream_at_ ABSL_GUARDED_BY(stream_mu_);
  bool told_ ABSL_GUARDED_BY(stream_mu_) = false;  // why there is no stream, logged once
};

}  // namespace pathways
