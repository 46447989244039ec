#include "worker/fetch_stream_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// kHeader, its length, the header.
std::string HeaderFrame(const rpc::FetchStreamHeader& header) {
  const std::string body = header.SerializeAsString();
  return absl::StrCat(std::string(1, kFetchHeader), EncodeFetchU32(static_cast<uint32_t>(body.size())), body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FetchStreamServer>> FetchStreamServer::Start(const std::string& ip, std::string token,
                                                                            std::string also, FetchFn fetch,
                                                                            FetchStreamTiming timing) {
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage at, ParseAddress(absl::StrCat(ip, ":1"), &length));
  if (at.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&at)->sin_port = 0;
  if (at.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&at)->sin6_port = 0;
  const int fd = socket(at.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&at), length) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length) != 0) {
    const int error = errno;
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("fetch stream cannot listen on ", ip, ": ", Errno(error)));
  }
  const int port = at.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&at)->sin_port)
                                           : ntohs(reinterpret_cast<sockaddr_in6*>(&at)->sin6_port);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("fetch stream: eventfd: ", Errno(errno)));
  }
  return std::unique_ptr<FetchStreamServer>(
      new FetchStreamServer(fd, port, wake, std::move(token), std::move(also), std::move(fetch), timing));
}

FetchStreamServer::FetchStreamServer(int listen_fd, int port, int wake_fd, std::string token, std::string also,
                                     FetchFn fetch, FetchStreamTiming timing)
    : listen_fd_(listen_fd),
      port_(port),
      wake_fd_(wake_fd),
      token_(std::move(token)),
      also_(std::move(also)),
      fetch_(std::move(fetch)),
      timing_(timing) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

FetchStreamServer::~FetchStreamServer() {
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (Connection& c : connections_) shutdown(c.fd, SHUT_RDWR);
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  acceptor_.join();
  {
    absl::MutexLock lock(&mu_);
    connections.splice(connections.end(), connections_);
  }
  for (Connection& c : connections) c.thread.join();
  close(listen_fd_);
  close(wake_fd_);
}

int64_t FetchStreamServer::answered() const {
  absl::MutexLock lock(&mu_);
  return answered_;
}

bool FetchStreamServer::stopping() const {
  absl::MutexLock lock(&mu_);
  return stop_;
}

void FetchStreamServer::AcceptLoop() {
  while (true) {
    pollfd polled[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(polled, 2, -1) < 0 && errno != EINTR) return;
    if (polled[1].revents != 0) return;
    if ((polled[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;  // (out of descriptors: the process's accept4 deals with it, core/process.cc)
    Configure(fd);
    std::list<Connection> finished;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        auto next = std::next(it);
        if (it->finished) finished.splice(finished.end(), connections_, it);
        it = next;
      }
      if (stop_ || connections_.size() >= kMaxConnections) {
        close(fd);
      } else {
        connections_.push_back({fd, {}, false});
        Connection* c = &connections_.back();
        c->thread = std::thread([this, c] { Serve(c); });
      }
    }
    for (Connection& c : finished) c.thread.join();  // threads that have ended
  }
}

absl::Status FetchStreamServer::Hello(int fd) {
  const absl::Time deadline = absl::Now() + timing_.connect;
  char hello[12];
  PW_RETURN_IF_ERROR(TransferAll(fd, hello, sizeof(hello), false, deadline, "hello"));
  if (std::memcmp(hello, kFetchStreamMagic, 8) != 0) return absl::InvalidArgumentError("not a fetch stream");
  const uint32_t length = DecodeFetchU32(hello + 8);
  if (length > kMaxFetchTokenBytes) return absl::InvalidArgumentError("a token that is too long");
  std::string token(length, '\0');
  PW_RETURN_IF_ERROR(TransferAll(fd, token.data(), length, false, deadline, "hello"));
  return CheckToken(token, token_, also_);
}

void FetchStreamServer::Serve(Connection* c) {
  const int fd = c->fd;
  // The header that says why a request (or the connection) is refused.
  auto refuse = [&](const absl::Status& why) {
    rpc::FetchStreamHeader header;
    header.set_code(static_cast<int>(why.code()));
    header.set_message(std::string(why.message()));
    std::string frame = HeaderFrame(header);
    return TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "refusal");
  };
  absl::Status s = Hello(fd);
  if (!s.ok() && absl::IsUnauthenticated(s)) (void)refuse(s);
  while (s.ok()) {
    pollfd polled[2] = {{fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int ready = poll(polled, 2, static_cast<int>(absl::ToInt64Milliseconds(kIdle)));
    if (ready <= 0 || polled[1].revents != 0 || (polled[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) break;
    const absl::Time deadline = absl::Now() + timing_.silence;
    char length[4];
    s = TransferAll(fd, length, 4, false, deadline, "request");
    if (!s.ok()) break;
    const uint32_t bytes = DecodeFetchU32(length);
    if (bytes > kMaxFetchRequestBytes) {
      (void)refuse(absl::InvalidArgumentError(absl::StrCat("a fetch request of ", bytes, " bytes (at most ",
                                                           kMaxFetchRequestBytes, ")")));
      break;
    }
    std::string body(bytes, '\0');
    s = TransferAll(fd, body.data(), bytes, false, deadline, "request");
    if (!s.ok()) break;
    rpc::FetchRequest request;
    if (!request.ParseFromString(body)) {
      s = refuse(absl::InvalidArgumentError("a fetch request that does not parse"));
      continue;
    }
    if (absl::Status client = CheckClientCredential(request.client_id(), request.credential()); !client.ok()) {
      s = refuse(client);
      continue;
    }
    s = Answer(fd, request);
  }
  absl::MutexLock lock(&mu_);
  close(fd);
  c->finished = true;
}

absl::Status FetchStreamServer::Answer(int fd, const rpc::FetchRequest& request) {
  Future<std::vector<BufferPtr>> buffers = fetch_(request);
  // While the data is not ready the client hears that this worker is alive, and a client that
  // went away is noticed.
  const char waiting = kFetchWaiting;
  while (!buffers.IsReady()) {
    (void)buffers.AwaitFor(timing_.keepalive);
    if (buffers.IsReady()) break;
    if (stopping()) return absl::CancelledError("the worker is stopping");
    PW_RETURN_IF_ERROR(TransferAll(fd, const_cast<char*>(&waiting), 1, true, absl::Now() + timing_.silence, "keepalive"));
  }
  const absl::StatusOr<std::vector<BufferPtr>>& r = buffers.Await();
  rpc::FetchStreamHeader header;
  if (!r.ok()) {
    header.set_code(static_cast<int>(r.status().code()));
    header.set_message(std::string(r.status().message()));
  } else if (!request.status_only()) {
    for (size_t i = 0; i < r->size(); ++i) {
      rpc::ShardData* d = header.add_shards();
      d->set_shard(request.shards(static_cast<int>(i)));
      *d->mutable_spec() = ToProto(TensorSpec{(*r)[i]->dtype(), (*r)[i]->shape()});
    }
  }
  std::string frame = HeaderFrame(header);
  PW_RETURN_IF_ERROR(TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "header"));
  if (r.ok() && !request.status_only()) {
    for (const BufferPtr& b : *r) {
      char* data = b->data();
      const size_t size = static_cast<size_t>(b->byte_size());
      for (size_t done = 0; done < size;) {
        const size_t piece = std::min(kFetchChunkBytes, size - done);
        PW_RETURN_IF_ERROR(TransferAll(fd, data + done, piece, true, absl::Now() + timing_.silence, "shard bytes"));
        done += piece;
      }
    }
  }
  absl::MutexLock lock(&mu_);
  ++answered_;
  return absl::OkStatus();
}

}  // namespace pathways
