#include "transport/controller_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <chrono>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/async_call.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

bool IsRunGroupOutOfStep(const absl::Status& status) {
  return absl::IsAborted(status) && absl::StrContains(status.message(), kRunGroupOutOfStep);
}

namespace {

template <typename Response, typename Fn>
absl::StatusOr<Response> CallWithDeadline(const std::string& address, const std::optional<std::string>& token,
                                          const char* what, Fn fn, absl::Duration deadline = absl::Seconds(10)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  AttachToken(context, token);
  Response response;
  grpc::Status status = fn(&context, &response);
  if (!status.ok()) return FromGrpc(status, absl::StrCat(what, " on controller ", address));
  return response;
}

}  // namespace

ControllerClient::ControllerClient(std::string address, std::optional<std::string> token)
    : address_(std::move(address)),
      token_(std::move(token)),
      channel_(grpc::CreateCustomChannel(address_, ChannelCredentials(), ChannelArgs())),
      stub_(rpc::Controller::NewStub(channel_)),
      dataflow_stub_(rpc::Dataflow::NewStub(channel_)) {}

absl::StatusOr<rpc::RegisterWorkerResponse> ControllerClient::RegisterWorker(
    const rpc::RegisterWorkerRequest& r) {
  return CallWithDeadline<rpc::RegisterWorkerResponse>(
      address_, token_, "RegisterWorker",
      [&](grpc::ClientContext* c, rpc::RegisterWorkerResponse* resp) {
        return stub_->RegisterWorker(c, r, resp);
      });
}

absl::StatusOr<rpc::HeartbeatResponse> ControllerClient::Heartbeat(const rpc::HeartbeatRequest& r) {
  return CallWithDeadline<rpc::HeartbeatResponse>(
      address_, token_, "Heartbeat",
      [&](grpc::ClientContext* c, rpc::HeartbeatResponse* resp) {
        return stub_->Heartbeat(c, r, resp);
      });
}

absl::StatusOr<rpc::ClusterStatus> ControllerClient::GetStatus(absl::Duration timeline) {
  rpc::GetStatusRequest request;
  request.set_timeline_ms(absl::ToInt64Milliseconds(timeline));
  return CallWithDeadline<rpc::ClusterStatus>(
      address_, token_, "GetStatus", [&](grpc::ClientContext* c, rpc::ClusterStatus* resp) {
        return stub_->GetStatus(c, request, resp);
      });
}

absl::StatusOr<rpc::AllocateSliceResponse> ControllerClient::AllocateSlice(
    const rpc::AllocateSliceRequest& r) {
  return CallWithDeadline<rpc::AllocateSliceResponse>(
      address_, token_, "AllocateSlice",
      [&](grpc::ClientContext* c, rpc::AllocateSliceResponse* resp) {
        return stub_->AllocateSlice(c, r, resp);
      });
}

absl::StatusOr<rpc::SliceStatesResponse> ControllerClient::SliceStates(const rpc::SliceStatesRequest& r) {
  return CallWithDeadline<rpc::SliceStatesResponse>(
      address_, token_, "SliceStates",
      [&](grpc::ClientContext* c, rpc::SliceStatesResponse* resp) { return stub_->SliceStates(c, r, resp); });
}

Future<rpc::SliceStatesResponse> ControllerClient::SliceStatesAsync(const rpc::SliceStatesRequest& r) {
  return AsyncUnaryCall<rpc::SliceStatesResponse>(
      absl::StrCat("SliceStates on controller ", address_), token_, r, absl::Seconds(5),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->SliceStates(ctx, req, resp, std::move(done)); });
}

absl::StatusOr<rpc::AllocateSliceResponse> ControllerClient::RemapSlice(const rpc::RemapSliceRequest& r) {
  return CallWithDeadline<rpc::AllocateSliceResponse>(
      address_, token_, "RemapSlice",
      [&](grpc::ClientContext* c, rpc::AllocateSliceResponse* resp) { return stub_->RemapSlice(c, r, resp); });
}

ControllerClient::~ControllerClient() {
  std::thread connector;
  std::vector<std::shared_ptr<ScheduleStream>> streams;
  {
    absl::MutexLock lock(&stream_mu_);
    stopping_ = true;
    connector = std::move(connector_);
  }
  if (connector.joinable()) connector.join();  // it joins nothing itself, so this cannot wait on a reader
  {
    absl::MutexLock lock(&stream_mu_);
    streams = std::move(retired_);
    streams.push_back(std::move(stream_));
  }
  // Destroyed without the lock (their readers' continuations may schedule again); one going on
  // its own reader thread leaves that thread to end by itself.
  streams.clear();
}

void ControllerClient::PreferScheduleStream() {
  {
    absl::MutexLock lock(&stream_mu_);
    prefer_stream_ = PlainControlStreams();  // not with TLS: the stream is not encrypted
  }
  (void)CurrentScheduleStream();  // starts connecting now, so the first requests may use it
}

std::shared_ptr<ScheduleStream> ControllerClient::CurrentScheduleStream() {
  absl::MutexLock lock(&stream_mu_);
  if (!prefer_stream_ || no_stream_) return nullptr;
  if (stream_ != nullptr && !stream_->broken()) return stream_;
  // None (yet), or it broke (the controller restarted, say): made again by the connector thread,
  // unary calls meanwhile. Nothing here waits, on the network or on a thread: this runs on
  // whatever thread sends a batch, gRPC's callback threads and streams' readers included.
  if (!connecting_ && !stopping_ && absl::Now() >= retry_stream_at_) {
    connecting_ = true;
    if (!connector_.joinable()) {
      try {
        connector_ = std::thread([this] { ConnectorLoop(); });
      } catch (const std::system_error&) {
        connecting_ = false;  // no thread to be had: unary calls, and asked again later
        retry_stream_at_ = absl::Now() + absl::Seconds(5);
      }
    }
  }
  return nullptr;
}

void ControllerClient::ConnectorLoop() {
  NameThisThread("sched-connect");
  while (true) {
    {
      absl::MutexLock lock(&stream_mu_);
      auto wanted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stream_mu_) { return connecting_ || stopping_; };
      stream_mu_.Await(absl::Condition(&wanted));
      if (stopping_) return;
    }
    ConnectScheduleStream();
  }
}

namespace {

// `host` (no brackets) as a numeric address (an IP as it is; a name resolved), for a plain TCP
// connection.
absl::StatusOr<std::string> NumericHost(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int e = getaddrinfo(host.c_str(), nullptr, &hints, &found); e != 0 || found == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(e)));
  }
  char text[INET6_ADDRSTRLEN] = {};
  const void* at = found->ai_family == AF_INET
                       ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr)
                       : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr);
  inet_ntop(found->ai_family, at, text, sizeof(text));
  freeaddrinfo(found);
  return std::string(text);
}

}  // namespace

void ControllerClient::ConnectScheduleStream() {
  constexpr absl::Duration kConnect = absl::Seconds(2);
  absl::Status failed;
  bool never = false;  // no stream is to be had from this controller: stop asking
  std::unique_ptr<ScheduleStream> made;
  std::string peer;  // the address gRPC reached the controller at ("ipv4:IP:PORT", "ipv6:[IP]:PORT")
  auto port = CallWithDeadline<rpc::StreamPortResponse>(
      address_, token_, "StreamPort",
      [&](grpc::ClientContext* c, rpc::StreamPortResponse* resp) {
        grpc::Status s = dataflow_stub_->StreamPort(c, rpc::StreamPortRequest(), resp);
        peer = c->peer();
        return s;
      },
      kConnect);
  if (!port.ok()) {
    failed = port.status();
    never = absl::IsUnimplemented(failed) || absl::IsPermissionDenied(failed) || absl::IsUnauthenticated(failed);
  } else if (port->port() <= 0 || port->port() > 65535) {
    failed = absl::UnavailableError("the controller has no stream listener");
    never = true;
  } else {
    // The IP gRPC connected to (a name may resolve to several, of which the controller listens
    // on one); else the address's host, resolved.
    std::string host = HostOfAddress(address_);
    for (const char* family : {"ipv4:", "ipv6:"}) {
      if (peer.rfind(family, 0) == 0 && !HostOfAddress(peer.substr(5)).empty()) host = HostOfAddress(peer.substr(5));
    }
    absl::StatusOr<std::string> ip = NumericHost(host);
    auto stream = ip.ok() ? ScheduleStream::Connect(address_, *ip, port->port(), kConnect, token_)
                          : absl::StatusOr<std::unique_ptr<ScheduleStream>>(ip.status());
    if (stream.ok()) {
      made = *std::move(stream);
    } else {
      failed = stream.status();
    }
  }
  absl::MutexLock lock(&stream_mu_);
  connecting_ = false;
  if (made != nullptr) {
    // A broken stream is parked, not destroyed here: destroying it joins its reader, which may be
    // running continuations that schedule again. The oldest go once there are many (their
    // readers ended long before).
    if (stream_ != nullptr) retired_.push_back(std::move(stream_));
    while (retired_.size() > kRetired) retired_.erase(retired_.begin());
    stream_ = std::move(made);
    return;
  }
  no_stream_ = never;
  retry_stream_at_ = absl::Now() + absl::Seconds(5);
  if (!told_) {
    PW_LOG(Info) << "Schedule on controller " << address_ << " goes as unary calls"
                 << (never ? "" : " for now") << ": " << failed;
    told_ = true;
  }
}

Future<Unit> ControllerClient::Schedule(rpc::ScheduleRequest request) {
  const absl::Time asked = absl::Now();
  auto r = std::make_shared<const rpc::ScheduleRequest>(std::move(request));
  if (std::shared_ptr<ScheduleStream> stream = CurrentScheduleStream(); stream != nullptr) {
    schedules_streamed_.fetch_add(1, std::memory_order_relaxed);
    Promise<Unit> promise;
    Future<Unit> result = promise.future();
    // A stream that broke (the controller went) before the request left: it goes as a unary
    // call, which waits for the controller.
    stream->Schedule(*r).OnReady([this, r, asked, promise = std::move(promise)](const absl::StatusOr<Unit>& done) mutable {
      if (done.ok() || !ScheduleStream::NeverSent(done.status())) {
        promise.Set(done);
        return;
      }
      schedules_unary_.fetch_add(1, std::memory_order_relaxed);
      UnarySchedule(r, asked).OnReady([promise = std::move(promise)](const absl::StatusOr<Unit>& again) mutable {
        promise.Set(again);
      });
    });
    return result;
  }
  schedules_unary_.fetch_add(1, std::memory_order_relaxed);
  return UnarySchedule(r, asked);
}

Future<Unit> ControllerClient::UnarySchedule(std::shared_ptr<const rpc::ScheduleRequest> r, absl::Time asked) {
  const std::string what = absl::StrCat("Schedule on controller ", address_);
  Future<Unit> sent = AsyncUnaryCall<rpc::ScheduleResponse>(
                          what, token_, *r, absl::InfiniteDuration(),
                          [this](auto* ctx, auto* req, auto* resp, auto done) {
                            stub_->async()->Schedule(ctx, req, resp, std::move(done));
                          })
                          .Then([](const rpc::ScheduleResponse&) { return Unit{}; });
  Promise<Unit> promise;
  Future<Unit> result = promise.future();
  sent.OnReady([this, r, asked, what, promise = std::move(promise)](const absl::StatusOr<Unit>& done) mutable {
    // gRPC's own words for a call it failed before sending, finding no connection (its channel
    // waits between attempts to reconnect), right after our prefix: an answer from the
    // controller never starts so.
    const bool unsent = absl::IsUnavailable(done.status()) &&
                        absl::StartsWith(done.status().message(), absl::StrCat(what, ": failed to connect to all addresses"));
    const absl::Duration left = asked + kReconnectWait - absl::Now();
    if (!unsent || left <= absl::ZeroDuration()) {
      promise.Set(done);
      return;
    }
    WhenReachable(left).OnReady(
        [this, r, asked, first = done.status(), promise = std::move(promise)](const absl::StatusOr<Unit>& up) mutable {
          if (!up.ok()) {
            promise.Set(first);
            return;
          }
          UnarySchedule(r, asked).OnReady([promise = std::move(promise)](const absl::StatusOr<Unit>& again) mutable {
            promise.Set(again);
          });
        });
  });
  return result;
}

Future<Unit> ControllerClient::WhenReachable(absl::Duration wait) {
  // StreamPort: the controller's cheapest call that every client may make.
  return AsyncUnaryCall<rpc::StreamPortResponse>(absl::StrCat("StreamPort on controller ", address_), token_,
                                                 rpc::StreamPortRequest(), wait,
                                                 [this](auto* ctx, auto* req, auto* resp, auto done) {
                                                   ctx->set_wait_for_ready(true);
                                                   dataflow_stub_->async()->StreamPort(ctx, req, resp,
                                                                                       std::move(done));
                                                 })
      .Then([](const rpc::StreamPortResponse&) { return Unit{}; });
}

absl::StatusOr<absl::Duration> ControllerClient::ClientHeartbeat(const ClientIdentity& client, bool goodbye) {
  rpc::ClientHeartbeatRequest request;
  request.set_client_id(client.id);
  request.set_credential(client.credential);
  request.set_goodbye(goodbye);
  auto response = CallWithDeadline<rpc::ClientHeartbeatResponse>(
      address_, token_, "ClientHeartbeat",
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
             address_, token_, "RendezvousSet",
             [&](grpc::ClientContext* c, rpc::RendezvousSetResponse* resp) { return stub_->RendezvousSet(c, request, resp); })
      .status();
}

absl::StatusOr<std::string> ControllerClient::RendezvousGet(const std::string& key, absl::Duration timeout) {
  rpc::RendezvousGetRequest request;
  request.set_key(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  auto response = CallWithDeadline<rpc::RendezvousGetResponse>(
      address_, token_, "RendezvousGet",
      [&](grpc::ClientContext* c, rpc::RendezvousGetResponse* resp) { return stub_->RendezvousGet(c, request, resp); },
      timeout + absl::Seconds(10));
  if (!response.ok()) return response.status();
  return std::move(*response->mutable_value());
}

}  // namespace pathways
