#include "transport/controller_client.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/async_call.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"
#include "core/logging.h"

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
      channel_(grpc::CreateCustomChannel(address_, ChannelCredentials(), ChannelArgs())),
      stub_(rpc::Controller::NewStub(channel_)) {}

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

void ControllerClient::PreferScheduleStream() {
  absl::MutexLock lock(&stream_mu_);
  prefer_stream_ = PlainControlStreams();  // not with TLS: the stream is not encrypted
}

ScheduleStream* ControllerClient::CurrentScheduleStream() {
  absl::MutexLock lock(&stream_mu_);
  if (!prefer_stream_) return nullptr;
  if (stream_ != nullptr && !stream_->broken()) return stream_.get();
  const absl::Time now = absl::Now();
  if (now < retry_stream_at_) return nullptr;
  if (stream_ != nullptr) broken_streams_.push_back(std::move(stream_));
  // Quick, and rare: once, and after a stream broke (the controller restarted, say).
  constexpr absl::Duration kConnect = absl::Seconds(2);
  if (stream_port_ < 0) {
    auto port = CallWithDeadline<rpc::StreamPortResponse>(
        address_, "StreamPort",
        [&](grpc::ClientContext* c, rpc::StreamPortResponse* resp) {
          return rpc::Dataflow::NewStub(channel_)->StreamPort(c, rpc::StreamPortRequest(), resp);
        },
        kConnect);
    // UNIMPLEMENTED or a failure: unary calls, asking again later.
    if (port.ok()) stream_port_ = port->port() > 0 && port->port() <= 65535 ? port->port() : 0;
  }
  absl::Status failed = absl::UnavailableError("the controller has no stream listener");
  if (stream_port_ > 0) {
    std::string ip = address_.substr(0, address_.rfind(':'));
    if (ip.size() > 2 && ip.front() == '[' && ip.back() == ']') ip = ip.substr(1, ip.size() - 2);
    auto stream = ScheduleStream::Connect(address_, ip, stream_port_, kConnect);
    if (stream.ok()) {
      stream_ = *std::move(stream);
      return stream_.get();
    }
    failed = stream.status();
    stream_port_ = -1;  // the controller may have restarted elsewhere: asked again
  }
  retry_stream_at_ = now + absl::Seconds(5);
  if (stream_port_ != 0 && !told_) {
    PW_LOG(Info) << "Schedule on controller " << address_ << " goes as unary calls: " << failed;
    told_ = true;  // once: a controller reached by name (not by IP) says so every time
  }
  while (broken_streams_.size() > 16) broken_streams_.erase(broken_streams_.begin());  // long done
  return nullptr;
}

Future<Unit> ControllerClient::Schedule(const rpc::ScheduleRequest& r) {
  if (ScheduleStream* stream = CurrentScheduleStream(); stream != nullptr) return stream->Schedule(r);
  return AsyncUnaryCall<rpc::ScheduleResponse>(
             absl::StrCat("Schedule on controller ", address_), r, absl::InfiniteDuration(),
             [this](auto* ctx, auto* req, auto* resp, auto done) {
               stub_->async()->Schedule(ctx, req, resp, std::move(done));
             })
      .Then([](const rpc::ScheduleResponse&) { return Unit{}; });
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
