#include "transport/fetch_stream.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "core/types.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

std::string EncodeFetchU32(uint32_t v) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

uint32_t DecodeFetchU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

FetchStreamClient::FetchStreamClient(std::string worker, std::string ip, int port, FetchStreamTiming timing)
    : worker_(std::move(worker)), ip_(std::move(ip)), port_(port), timing_(timing) {}

namespace {
constexpr char kNotSentPayload[] = "pathways.dev/fetch-stream-not-sent";
}  // namespace

bool FetchStreamClient::NotSent(const absl::Status& status) {
  return status.GetPayload(kNotSentPayload).has_value();
}

void FetchStreamClient::Stop() {
  absl::MutexLock lock(&mu_);
  stop_ = true;
  for (auto& c : connections_) {
    if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);  // a fetch in flight fails at once
  }
}

FetchStreamClient::~FetchStreamClient() {
  Stop();
  std::vector<std::unique_ptr<Connection>> connections;
  {
    absl::MutexLock lock(&mu_);
    connections = std::move(connections_);
  }
  for (auto& c : connections) c->thread.join();
}

std::optional<Future<FetchedShards>> FetchStreamClient::Fetch(rpc::FetchRequest request, uint64_t max_bytes) {
  absl::MutexLock lock(&mu_);
  if (stop_) return std::nullopt;
  Connection* idle = nullptr;
  for (auto& c : connections_) {
    if (!c->busy) {
      idle = c.get();
      break;
    }
  }
  if (idle == nullptr) {
    if (static_cast<int>(connections_.size()) >= kMaxConnections) return std::nullopt;
    connections_.push_back(std::make_unique<Connection>());
    idle = connections_.back().get();
    idle->thread = std::thread([this, idle] { Serve(idle); });
  }
  idle->busy = true;
  idle->request = std::move(request);
  idle->max_bytes = max_bytes;
  idle->promise = Promise<FetchedShards>();
  return idle->promise.future();
}

void FetchStreamClient::Serve(Connection* c) {
  while (true) {
    rpc::FetchRequest request;
    uint64_t max_bytes = 0;
    int fd = -1;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this, c]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || c->request.has_value(); };
      mu_.Await(absl::Condition(&has_work));
      if (stop_) {
        if (c->request.has_value()) c->promise.Set(absl::CancelledError("the client is closing"));
        if (c->fd >= 0) close(c->fd);
        c->fd = -1;
        return;
      }
      request = *std::move(c->request);
      c->request.reset();
      max_bytes = c->max_bytes;
      fd = c->fd;
    }
    absl::StatusOr<FetchedShards> result;
    if (fd < 0) {
      absl::StatusOr<int> dialed = Dial();
      if (dialed.ok()) {
        absl::MutexLock lock(&mu_);
        c->fd = fd = *dialed;
        if (stop_) shutdown(fd, SHUT_RDWR);
      } else {
        absl::Status not_sent = dialed.status();
        not_sent.SetPayload(kNotSentPayload, absl::Cord("1"));
        result = not_sent;
      }
    }
    if (fd >= 0) result = RunOne(fd, request, max_bytes);
    Promise<FetchedShards> promise;
    {
      absl::MutexLock lock(&mu_);
      // A failed exchange leaves the stream at an unknown place: the next fetch dials again.
      if (!result.ok() && c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
      }
      promise = std::move(c->promise);
      c->busy = false;  // before the result is set: a continuation's next fetch may take it
    }
    promise.Set(std::move(result));
  }
}

absl::StatusOr<int> FetchStreamClient::Dial() {
  const std::string what = absl::StrCat("fetch stream to worker ", worker_);
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage to, ParseAddress(absl::StrCat(ip_, ":", port_), &length));
  const int fd = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(what, ": ", Errno(errno)));
  const absl::Time deadline = absl::Now() + timing_.connect;
  absl::Status s;
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), length) != 0) {
    if (errno != EINPROGRESS) {
      s = absl::UnavailableError(absl::StrCat(what, ": connecting: ", Errno(errno)));
    } else {
      pollfd p{fd, POLLOUT, 0};
      int error = 0;
      socklen_t error_length = sizeof(error);
      if (poll(&p, 1, RemainingMs(deadline)) != 1) {
        s = absl::UnavailableError(absl::StrCat(what, ": connecting timed out"));
      } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &error_length) != 0 || error != 0) {
        s = absl::UnavailableError(absl::StrCat(what, ": connecting: ", Errno(error)));
      }
    }
  }
  if (s.ok()) {
    Configure(fd);
    const std::string token = CallToken();
    std::string hello = absl::StrCat(std::string(kFetchStreamMagic, 8), EncodeFetchU32(static_cast<uint32_t>(token.size())), token);
    s = TransferAll(fd, hello.data(), hello.size(), true, deadline, absl::StrCat(what, ": hello"));
  }
  if (!s.ok()) {
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<FetchedShards> FetchStreamClient::RunOne(int fd, const rpc::FetchRequest& request,
                                                             uint64_t max_bytes) {
  const std::string what = absl::StrCat("fetch stream from worker ", worker_);
  const std::string body = request.SerializeAsString();
  std::string frame = absl::StrCat(EncodeFetchU32(static_cast<uint32_t>(body.size())), body);
  PW_RETURN_IF_ERROR(TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence,
                                 absl::StrCat(what, ": sending the request")));
  // Reads `n` bytes, each piece within the silence bound; a silent worker is named as such.
  auto read = [&](char* into, size_t n, const char* part) -> absl::Status {
    for (size_t done = 0; done < n;) {
      const size_t piece = std::min(kFetchChunkBytes, n - done);
      absl::Status s = TransferAll(fd, into + done, piece, false, absl::Now() + timing_.silence,
                                   absl::StrCat(what, ": ", part));
      if (absl::IsDeadlineExceeded(s)) {
        return absl::UnavailableError(absl::StrCat(what, ": nothing came for ",
                                                   absl::FormatDuration(timing_.silence), " (", part,
                                                   "): the worker is frozen, overloaded or cut off"));
      }
      PW_RETURN_IF_ERROR(s);
      done += piece;
    }
    return absl::OkStatus();
  };
  char kind = kFetchWaiting;
  while (kind == kFetchWaiting) PW_RETURN_IF_ERROR(read(&kind, 1, "waiting for the data"));
  if (kind != kFetchHeader) return absl::DataLossError(absl::StrCat(what, ": a byte that starts no answer"));
  char length[4];
  PW_RETURN_IF_ERROR(read(length, 4, "the header"));
  const uint32_t header_bytes = DecodeFetchU32(length);
  if (header_bytes > kMaxFetchHeaderBytes) {
    return absl::DataLossError(absl::StrCat(what, ": a header of ", header_bytes, " bytes"));
  }
  std::string header_data(header_bytes, '\0');
  PW_RETURN_IF_ERROR(read(header_data.data(), header_bytes, "the header"));
  rpc::FetchStreamHeader header;
  if (!header.ParseFromString(header_data)) return absl::DataLossError(absl::StrCat(what, ": a header that does not parse"));
  if (header.code() != 0) {
    const int code = header.code();
    return absl::Status(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                        header.message());
  }
  auto response = std::make_shared<rpc::FetchResponse>();
  if (request.status_only()) return response;
  uint64_t total = 0;
  for (rpc::ShardData& shard : *header.mutable_shards()) {
    absl::StatusOr<TensorSpec> spec = FromProto(shard.spec());
    absl::StatusOr<int64_t> bytes = spec.ok() ? ByteSize(spec->dtype, spec->shape) : spec.status();
    if (!bytes.ok() || *bytes < 0 || total + static_cast<uint64_t>(*bytes) > max_bytes) {
      return absl::DataLossError(absl::StrCat(what, ": shard ", shard.shard(), " is not of the array's size"));
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
