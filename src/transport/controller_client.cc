#include "transport/controller_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <pthread.h>

#include <chrono>
#include <system_error>
#include <utility>

#include "core/socket_util.h"
#include "absl/strings/match.h"
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

// A call gRPC failed before sending it: its channel had no connection to the controller and
// could not make one ("failed to connect to all addresses", gRPC's words for a call that found
// no connection to send on).
bool NeverSent(const absl::Status& s) {
  return absl::IsUnavailable(s) && absl::StrContains(s.message(), "failed to connect to all addresses");
}

}  // namespace

ControllerClient::ControllerClient(std::string address, std::optional<std::string> token)
    : address_(std::move(address)),
      token_(std::move(token)),
      channel_(grpc::CreateCustomChannel(address_, ChannelCredentials(), ChannelArgs())),
      stub_(rpc::Controller::NewStub(channel_)) {}

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
    if (!EnsureConnectorLocked()) {
      connecting_ = false;  // no thread to be had: unary calls, and asked again later
      retry_stream_at_ = absl::Now() + absl::Seconds(5);
    }
  }
  return nullptr;
}

bool ControllerClient::EnsureConnectorLocked() {
  if (connector_.joinable()) return true;
  try {
    connector_ = std::thread([this] { ConnectorLoop(); });
    return true;
  } catch (const std::system_error&) {
    return false;
  }
}

void ControllerClient::ConnectorLoop() {
  pthread_setname_np(pthread_self(), "sched-connect");
  while (true) {
    bool connect = false, send = false;
    {
      absl::MutexLock lock(&stream_mu_);
      auto wanted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stream_mu_) {
        return connecting_ || stopping_ || !parked_.empty();
      };
      stream_mu_.Await(absl::Condition(&wanted));
      if (stopping_) break;
      connect = connecting_;
      send = !parked_.empty();
    }
    if (connect) ConnectScheduleStream();
    if (send) SendParked();
  }
  std::vector<Parked> parked;
  {
    absl::MutexLock lock(&stream_mu_);
    parked.swap(parked_);
  }
  for (Parked& p : parked) {
    p.promise.Set(absl::CancelledError(absl::StrCat("Schedule on controller ", address_,
                                                    ": the client closed while it waited to reach the controller")));
  }
}

void ControllerClient::SendParked() {
  absl::Time deadline;
  {
    absl::MutexLock lock(&stream_mu_);
    if (parked_.empty()) return;
    deadline = parked_.front().since + kReconnectWait;
  }
  // In steps, so that closing the client does not wait for the whole of it.
  while (absl::Now() < deadline &&
         !channel_->WaitForConnected(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Milliseconds(250))))) {
    absl::MutexLock lock(&stream_mu_);
    if (stopping_) return;
  }
  std::vector<Parked> parked;
  {
    absl::MutexLock lock(&stream_mu_);
    parked.swap(parked_);
  }
  // Connected, or not within the wait: then sent all the same, and gRPC's error says why.
  for (Parked& p : parked) SendNow(std::move(p));
}

bool ControllerClient::Park(Parked& p) {
  absl::MutexLock lock(&stream_mu_);
  if (stopping_ || !EnsureConnectorLocked()) return false;
  parked_.push_back(std::move(p));
  return true;
}

void ControllerClient::SendUnary(Parked p) {
  // gRPC fails a call at once while its channel waits between connection attempts: such a
  // request waits for the connector thread, which sends it once the channel connects.
  if (channel_->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY && Park(p)) return;
  SendNow(std::move(p));
}

void ControllerClient::SendNow(Parked p) {
  auto shared = std::make_shared<Parked>(std::move(p));
  // The channel may not have seen its connection go yet: a call it then fails unsent waits too.
  UnarySchedule(shared->request).OnReady([this, shared](const absl::StatusOr<Unit>& r) {
    if (!r.ok() && NeverSent(r.status()) && absl::Now() < shared->since + kReconnectWait && Park(*shared)) return;
    shared->promise.Set(r);
  });
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
        grpc::Status s = rpc::Dataflow::NewStub(channel_)->StreamPort(c, rpc::StreamPortRequest(), resp);
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

Future<Unit> ControllerClient::Schedule(const rpc::ScheduleRequest& r) {
  if (std::shared_ptr<ScheduleStream> stream = CurrentScheduleStream(); stream != nullptr) {
    schedules_streamed_.fetch_add(1, std::memory_order_relaxed);
    return stream->Schedule(r);
  }
  Parked p{r, Promise<Unit>(), absl::Now()};
  Future<Unit> done = p.promise.future();
  SendUnary(std::move(p));
  return done;
}

Future<Unit> ControllerClient::UnarySchedule(const rpc::ScheduleRequest& r) {
  schedules_unary_.fetch_add(1, std::memory_order_relaxed);
  return AsyncUnaryCall<rpc::ScheduleResponse>(
             absl::StrCat("Schedule on controller ", address_), token_, r, absl::InfiniteDuration(),
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
