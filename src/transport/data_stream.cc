#include "transport/data_stream.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "core/types.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

DataStreamClient::DataStreamClient(std::string worker, std::string ip, int port, DataStreamTiming timing,
                                   std::optional<std::string> token)
    : worker_(std::move(worker)), ip_(std::move(ip)), port_(port), timing_(timing), token_(std::move(token)) {}

namespace {

constexpr char kNotSentPayload[] = "pathways.dev/data-stream-not-sent";

// `status`, marked as a fetch the worker never served (see WhyNotSent).
absl::Status NotSentBecause(absl::Status status, DataStreamClient::NotSentReason reason) {
  status.SetPayload(kNotSentPayload,
                    absl::Cord(reason == DataStreamClient::NotSentReason::kUnreachable ? "unreachable" : "busy"));
  return status;
}

}  // namespace

DataStreamClient::NotSentReason DataStreamClient::WhyNotSent(const absl::Status& status) {
  const auto reason = status.GetPayload(kNotSentPayload);
  if (!reason.has_value()) return NotSentReason::kSent;
  return *reason == "unreachable" ? NotSentReason::kUnreachable : NotSentReason::kBusy;
}

void DataStreamClient::Stop() {
  absl::MutexLock lock(&mu_);
  stop_ = true;
  for (auto& c : connections_) {
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);  // a fetch in flight fails at once
  }
}

DataStreamClient::~DataStreamClient() {
  Stop();
  std::vector<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    connections = std::move(connections_);
  }
  for (auto& c : connections) c->thread.join();
}

std::optional<Future<FetchedShards>> DataStreamClient::Fetch(rpc::FetchRequest request, uint64_t max_bytes) {
  Request r;
  *r.message.mutable_fetch() = std::move(request);
  r.max_bytes = max_bytes;
  return Submit(std::move(r));
}

std::optional<Future<Unit>> DataStreamClient::Stage(rpc::StageRequest request,
                                                    std::shared_ptr<const std::string> bytes) {
  absl::StatusOr<TensorSpec> spec = FromProto(request.spec());
  absl::StatusOr<int64_t> size = spec.ok() ? ByteSize(spec->dtype, spec->shape) : spec.status();
  if (!size.ok() || static_cast<uint64_t>(*size) != bytes->size()) {
    return Future<Unit>::Ready(absl::InvalidArgumentError(
        absl::StrCat("stage of ", bytes->size(), " bytes for a spec of ",
                     size.ok() ? absl::StrCat(*size, " bytes") : std::string(size.status().message()))));
  }
  Request r;
  *r.message.mutable_stage() = std::move(request);
  r.payload = std::move(bytes);
  auto sent = Submit(std::move(r));
  if (!sent.has_value()) return std::nullopt;
  return sent->Then([](const FetchedShards&) { return Unit{}; });
}

std::optional<Future<Unit>> DataStreamClient::Enqueue(const rpc::EnqueueRequest& request) {
  if (request.ByteSizeLong() + 16 > kMaxStreamRequestBytes) return std::nullopt;  // 16: the oneof's framing, at most
  Request r;
  *r.message.mutable_enqueue() = request;
  auto sent = Submit(std::move(r));
  if (!sent.has_value()) return std::nullopt;
  return sent->Then([](const FetchedShards&) { return Unit{}; });
}

bool DataStreamClient::WaitForConnectionsAtMost(int n, absl::Duration timeout) {
  auto few = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::count_if(connections_.begin(), connections_.end(), [](const auto& c) { return !c->ended; }) <= n;
  };
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&few), timeout);
}

std::optional<Future<FetchedShards>> DataStreamClient::Submit(Request request) {
  std::vector<std::unique_ptr<Connection>> ended;  // joined once the lock is released
  absl::Cleanup join_ended = [&ended] {
    for (auto& c : ended) c->thread.join();
  };
  absl::MutexLock lock(&mu_);
  if (stop_) return std::nullopt;
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->ended) {
      ended.push_back(std::move(*it));
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
  Connection* idle = nullptr;
  for (auto& c : connections_) {
    if (!c->busy) {
      idle = c.get();
      break;
    }
  }
  if (idle == nullptr) {
    if (static_cast<int>(connections_.size()) >= kMaxConnections) return std::nullopt;
    auto fresh = std::make_unique<Connection>();
    try {
      fresh->thread = std::thread([this, c = fresh.get()] {
        NameThisThread("data-stream");  // not the name of the thread that made it
        Serve(c);
      });
    } catch (const std::system_error&) {
      return std::nullopt;  // no thread to be had: the caller uses gRPC
    }
    connections_.push_back(std::move(fresh));
    idle = connections_.back().get();
  }
  idle->busy = true;
  idle->request = std::move(request);
  idle->promise = Promise<FetchedShards>();
  return idle->promise.future();
}

void DataStreamClient::SetFd(Connection* c, int fd) {
  absl::MutexLock lock(&mu_);
  if (c->fd >= 0) close(c->fd);
  c->fd = fd;
  if (stop_ && fd >= 0) shutdown(fd, SHUT_RDWR);
}

absl::StatusOr<FetchedShards> DataStreamClient::Exchange(Connection* c, const Request& request) {
  int fd;
  {
    absl::MutexLock lock(&mu_);
    fd = c->fd;
  }
  // A kept connection the worker closed meanwhile (its idle bound, a restart) is dialed afresh;
  // so is one that fails before any answer came, once (fetches only read, so sending again is
  // safe, and so is staging the same bytes again). Settled: an answer (or part of one) came, the
  // worker went silent (it is frozen: another way would wait on it too), it turned the request
  // away itself, or an enqueue was written whole: the worker may have applied its ops before the
  // connection went (a worker that stops closes its connections), so it is never sent again.
  const bool reused = fd >= 0 && !PeerClosed(fd);
  for (bool fresh = !reused;; fresh = true) {
    if (fresh) {
      absl::StatusOr<int> dialed = Dial();
      if (!dialed.ok()) return NotSentBecause(dialed.status(), NotSentReason::kUnreachable);
      SetFd(c, fd = *dialed);
    }
    Heard heard = Heard::kNothing;
    bool written = false;
    absl::StatusOr<FetchedShards> result = RunOne(fd, request, &heard, &written);
    if (result.ok() || heard != Heard::kNothing || WhyNotSent(result.status()) != NotSentReason::kSent) return result;
    if (written && request.message.has_enqueue()) return result;
    // A fresh connection closed before any answer: the worker is full, or going; gRPC will tell.
    if (fresh) return NotSentBecause(result.status(), NotSentReason::kBusy);
  }
}

void DataStreamClient::Serve(Connection* c) {
  while (true) {
    Request request;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this, c]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || c->request.has_value(); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&has_work), timing_.client_idle)) {
        // Idle: the connection and its thread go (the next Submit joins it); a later request
        // dials a new one.
        if (c->fd >= 0) close(c->fd);
        c->fd = -1;
        c->ended = true;
        return;
      }
      if (stop_) break;
      request = *std::move(c->request);
      c->request.reset();
    }
    absl::StatusOr<FetchedShards> result = Exchange(c, request);
    Promise<FetchedShards> promise;
    {
      absl::MutexLock lock(&mu_);
      // A failed exchange leaves the stream at an unknown place: the next fetch dials again.
      if (!result.ok() && c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
      }
      promise = std::move(c->promise);
    }
    // The connection is taken until its continuations have run: one that fetches again (and
    // waits) gets another connection, never this one.
    promise.Set(std::move(result));
    absl::MutexLock lock(&mu_);
    c->busy = false;
  }
  Promise<FetchedShards> pending;
  {
    absl::MutexLock lock(&mu_);
    if (c->request.has_value()) pending = std::move(c->promise);
    c->request.reset();
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
  }
  // Never sent: the caller may send it another way (the stream is stopped when the worker moved).
  if (pending.valid()) pending.Set(NotSentBecause(absl::CancelledError("the data stream was stopped"), NotSentReason::kBusy));
}

absl::StatusOr<int> DataStreamClient::Dial() {
  return DialStream(absl::StrCat("data stream to worker ", worker_), ip_, port_,
                    std::string(kDataStreamMagic, kStreamMagicBytes), TokenOr(token_), timing_.connect);
}

absl::StatusOr<FetchedShards> DataStreamClient::RunOne(int fd, const Request& r, Heard* heard, bool* written) {
  *heard = Heard::kNothing;
  const bool stage = r.message.has_stage();
  const bool enqueue = r.message.has_enqueue();
  const std::string what = absl::StrCat("data stream ", stage || enqueue ? "to" : "from", " worker ", worker_);
  const std::string body = r.message.SerializeAsString();
  std::string frame = absl::StrCat(EncodeStreamU32(static_cast<uint32_t>(body.size())), body);
  PW_RETURN_IF_ERROR(TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence,
                                 absl::StrCat(what, ": sending the request")));
  if (stage) {
    // A worker that refused the request closed the connection: sending fails (or its answer
    // below says why). Either way nothing was kept.
    PW_RETURN_IF_ERROR(TransferWhileMoving(fd, const_cast<char*>(r.payload->data()), r.payload->size(), true,
                                           timing_.silence, absl::StrCat(what, ": sending the bytes")));
  }
  *written = true;
  const rpc::FetchRequest& request = r.message.fetch();
  const uint64_t max_bytes = r.max_bytes;
  // Reads `n` bytes, failing once none came for the silence bound; a silent worker is named as such.
  // An enqueue is answered once its ops are applied, with no keepalives meanwhile: registering a
  // large program on a loaded host can take seconds, so its answer is waited for as long as
  // gRPC's Enqueue would be.
  const absl::Duration silence = enqueue ? std::max(timing_.silence, kEnqueueAnswerBound) : timing_.silence;
  auto read = [&](char* into, size_t n, const char* part) -> absl::Status {
    absl::Status s = TransferWhileMoving(fd, into, n, false, silence, absl::StrCat(what, ": ", part));
    if (absl::IsDeadlineExceeded(s)) {
      if (*heard == Heard::kNothing) *heard = Heard::kSilence;
      return absl::UnavailableError(absl::StrCat(what, ": nothing came for ", absl::FormatDuration(silence),
                                                 " (", part, "): the worker is frozen, overloaded or cut off"));
    }
    return s;
  };
  char kind = kStreamWaiting;
  while (kind == kStreamWaiting) {
    PW_RETURN_IF_ERROR(read(&kind, 1, enqueue ? "waiting for the ops to be taken" : "waiting for the data"));
    *heard = Heard::kSomething;
  }
  if (kind != kStreamHeader) return absl::DataLossError(absl::StrCat(what, ": a byte that starts no answer"));
  char length[4];
  PW_RETURN_IF_ERROR(read(length, 4, "the header"));
  const uint32_t header_bytes = DecodeStreamU32(length);
  if (header_bytes > kMaxStreamHeaderBytes) {
    return absl::DataLossError(absl::StrCat(what, ": a header of ", header_bytes, " bytes"));
  }
  std::string header_data(header_bytes, '\0');
  PW_RETURN_IF_ERROR(read(header_data.data(), header_bytes, "the header"));
  rpc::StreamHeader header;
  if (!header.ParseFromString(header_data)) return absl::DataLossError(absl::StrCat(what, ": a header that does not parse"));
  if (header.code() != 0) {
    // Named as the gRPC path names it, so errors read the same whichever way a fetch went.
    const int code = header.code();
    absl::Status refused(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                         absl::StrCat(stage ? "Stage" : enqueue ? "Enqueue" : "Fetch", " on worker ", worker_, ": ",
                                      header.message()));
    return header.not_served() ? NotSentBecause(refused, NotSentReason::kBusy) : refused;
  }
  auto response = std::make_shared<rpc::FetchResponse>();
  if (stage || enqueue || request.status_only()) return response;
  uint64_t total = 0;
  for (rpc::ShardData& shard : *header.mutable_shards()) {
    absl::StatusOr<TensorSpec> spec = FromProto(shard.spec());
    absl::StatusOr<int64_t> bytes = spec.ok() ? ByteSize(spec->dtype, spec->shape) : spec.status();
    if (!bytes.ok() || *bytes < 0) {
      return absl::DataLossError(absl::StrCat(what, ": shard ", shard.shard(), " has no valid spec"));
    }
    if (total + static_cast<uint64_t>(*bytes) > max_bytes) {
      return absl::DataLossError(absl::StrCat(what, ": the shards sent hold more than the ", max_bytes,
                                              " bytes asked for"));
    }
    total += static_cast<uint64_t>(*bytes);
    rpc::ShardData* out = response->add_shards();
    out->set_shard(shard.shard());
    *out->mutable_spec() = std::move(*shard.mutable_spec());
    std::string* data = out->mutable_data();
    data->resize(static_cast<size_t>(*bytes));
    PW_RETURN_IF_ERROR(read(data->data(), data->size(), "the shards' bytes"));
  }
  return response;
}

}  // namespace pathways
