// Blocking calls to the controller. Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/future.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/auth.h"

namespace pathways {

class ControllerClient {
 public:
  explicit ControllerClient(std::string address);
  const std::string& address() const { return address_; }

  absl::StatusOr<rpc::RegisterWorkerResponse> RegisterWorker(const rpc::RegisterWorkerRequest& r);
  absl::StatusOr<rpc::HeartbeatResponse> Heartbeat(const rpc::HeartbeatRequest& r);
  absl::StatusOr<rpc::ClusterStatus> GetStatus();
  absl::StatusOr<rpc::AllocateSliceResponse> AllocateSlice(const rpc::AllocateSliceRequest& r);
  absl::StatusOr<rpc::SliceStatesResponse> SliceStates(const rpc::SliceStatesRequest& r);
  absl::StatusOr<rpc::AllocateSliceResponse> RemapSlice(const rpc::RemapSliceRequest& r);
  // Submits runs to island schedulers; completes once their hosts have them. Asynchronous.
  Future<rpc::ScheduleResponse> Schedule(const rpc::ScheduleRequest& r);
  // Renews the client's lease (or ends it, with `goodbye`); returns the interval to renew at.
  absl::StatusOr<absl::Duration> ClientHeartbeat(const ClientIdentity& client, bool goodbye);
  absl::Status RendezvousSet(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> RendezvousGet(const std::string& key, absl::Duration timeout);

 private:
  const std::string address_;
  std::unique_ptr<rpc::Controller::Stub> stub_;
};

}  // namespace pathways
