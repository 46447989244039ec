#include "transport/controller_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/async_call.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

template <typename Response, typename Fn>
absl::StatusOr<Response> CallWithDeadline(const std::string& address, const char* what, Fn fn,
                                          absl::Duration deadline = absl::Seconds(10)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  AttachCallToken(context);
  Response response;
  grpc::Status status = fn(&context, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat(what, " on controller ", address));
  return response;
}

}  // namespace

ControllerClient::ControllerClient(std::string address)
    : address_(std::move(address)),
      stub_(rpc::Controller::NewStub(
          grpc::CreateCustomChannel(address_, ChannelCredentials(), ChannelArgs()))) {}

absl::StatusOr<rpc::RegisterWorkerResponse> ControllerClient::RegisterWorker(
    const rpc::RegisterWorkerRequest& r) {
  return CallWithDeadline<rpc::RegisterWorkerResponse>(
      address_, "RegisterWorker",
      [&](grpc::ClientContext* c, rpc::RegisterWorkerResponse* resp) {
        return stub_->RegisterWorker(c, r, resp);
      });
}

absl::StatusOr<rpc::HeartbeatResponse> ControllerClient::Heartbeat(const rpc::HeartbeatRequest& r) {
  return CallWithDeadline<rpc::HeartbeatResponse>(
      address_, "Heartbeat",
      [&](grpc::ClientContext* c, rpc::HeartbeatResponse* resp) {
        return stub_->Heartbeat(c, r, resp);
      });
}

absl::StatusOr<rpc::ClusterStatus> ControllerClient::GetStatus() {
  return CallWithDeadline<rpc::ClusterStatus>(
      address_, "GetStatus", [&](grpc::ClientContext* c, rpc::ClusterStatus* resp) {
        return stub_->GetStatus(c, rpc::GetStatusRequest(), resp);
      });
}

absl::StatusOr<rpc::AllocateSliceResponse> ControllerClient::AllocateSlice(
    const rpc::AllocateSliceRequest& r) {
  return CallWithDeadline<rpc::AllocateSliceResponse>(
      address_, "AllocateSlice",
      [&](grpc::ClientContext* c, rpc::AllocateSliceResponse* resp) {
        return stub_->AllocateSlice(c, r, resp);
      });
}

absl::StatusOr<rpc::SliceStatesResponse> ControllerClient::SliceStates(const rpc::SliceStatesRequest& r) {
  return CallWithDeadline<rpc::SliceStatesResponse>(
      address_, "SliceStates",
      [&](grpc::ClientContext* c, rpc::SliceStatesResponse* resp) { return stub_->SliceStates(c, r, resp); });
}

absl::StatusOr<rpc::AllocateSliceResponse> ControllerClient::RemapSlice(const rpc::RemapSliceRequest& r) {
  return CallWithDeadline<rpc::AllocateSliceResponse>(
      address_, "RemapSlice",
      [&](grpc::ClientContext* c, rpc::AllocateSliceResponse* resp) { return stub_->RemapSlice(c, r, resp); });
}

Future<rpc::ScheduleResponse> ControllerClient::Schedule(const rpc::ScheduleRequest& r) {
  return AsyncUnaryCall<rpc::ScheduleResponse>(
      absl::StrCat("Schedule on controller ", address_), r, absl::InfiniteDuration(),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Schedule(ctx, req, resp, std::move(done)); });
}

absl::StatusOr<absl::Duration> ControllerClient::ClientHeartbeat(const ClientIdentity& client, bool goodbye) {
  rpc::ClientHeartbeatRequest request;
  request.set_client_id(client.id);
  request.set_credential(client.credential);
  request.set_goodbye(goodbye);
  auto response = CallWithDeadline<rpc::ClientHeartbeatResponse>(
      address_, "ClientHeartbeat",
      [&](grpc::ClientContext* c, rpc::ClientHeartbeatResponse* resp) { return stub_->ClientHeartbeat(c, request, resp); },
      absl::Seconds(2));
  if (!response.ok()) return response.status();
  return absl::Milliseconds(response->interval_ms());
}

absl::Status ControllerClient::RendezvousSet(const std::string& key, const std::string& value) {
  rpc::RendezvousSetRequest request;
  request.set_key(key);
  request.set_value(value);
  return CallWithDeadline<rpc::RendezvousSetResponse>(
             address_, "RendezvousSet",
             [&](grpc::ClientContext* c, rpc::RendezvousSetResponse* resp) { return stub_->RendezvousSet(c, request, resp); })
      .status();
}

absl::StatusOr<std::string> ControllerClient::RendezvousGet(const std::string& key, absl::Duration timeout) {
  rpc::RendezvousGetRequest request;
  request.set_key(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  auto response = CallWithDeadline<rpc::RendezvousGetResponse>(
      address_, "RendezvousGet",
      [&](grpc::ClientContext* c, rpc::RendezvousGetResponse* resp) { return stub_->RendezvousGet(c, request, resp); },
      timeout + absl::Seconds(10));
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_value());
}

}  // namespace pathways
