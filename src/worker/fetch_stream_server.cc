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
                                                                            FetchStreamTiming timing, int port) {
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage at, ParseAddress(absl::StrCat(ip, ":1"), &length));
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("fetch stream port ", port));
  if (at.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&at)->sin_port = htons(static_cast<uint16_t>(port));
  if (at.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&at)->sin6_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(at.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  // Address reuse (not port reuse): a port whose earlier connections linger in TIME_WAIT can be
  // listened on again; one that a live listener holds cannot.
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&at), length) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&at), &length) != 0) {
    const int error = errno;
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("fetch stream cannot listen on ", ip, ": ", Errno(error)));
  }
  port = at.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&at)->sin_port)
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
    for (Connection& c : connections_) {
      if (!c.finished) shutdown(c.fd, SHUT_RDWR);  // (a finished one's descriptor is closed: maybe reused)
    }
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
    if (fd < 0) {
      // Out of descriptors or over the port's cap (core/process.cc): the connection may stay
      // queued, and poll() would return at once.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    Configure(fd);
    std::list<Connection> finished;
    bool served = false;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        auto next = std::next(it);
        if (it->finished) finished.splice(finished.end(), connections_, it);
        it = next;
      }
      if (!stop_ && connections_.size() < kMaxConnections) {
        connections_.push_back({fd, {}, false});
        Connection* c = &connections_.back();
        try {
          c->thread = std::thread([this, c] { Serve(c); });
          served = true;
        } catch (const std::system_error&) {
          connections_.pop_back();  // no thread to be had
        }
      }
    }
    if (!served) TurnAway(fd);
    for (Connection& c : finished) c.thread.join();  // threads that have ended
  }
}

// Full: the client hears that its fetch was not served, and fetches through gRPC instead. The
// connection is closed at once (its hello and request are read first if they came, so the close
// does not reset the answer away; a client that sees a reset anyway also takes gRPC).
void FetchStreamServer::TurnAway(int fd) {
  rpc::FetchStreamHeader header;
  header.set_code(static_cast<int>(absl::StatusCode::kUnavailable));
  header.set_message("its fetch streams are all taken");
  header.set_not_served(true);
  std::string frame = HeaderFrame(header);
  (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  shutdown(fd, SHUT_WR);
  char sink[4096];
  (void)!recv(fd, sink, sizeof(sink), MSG_DONTWAIT);  // one read, bounded: a hello and a request
  close(fd);
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
  c->finished = true;  // its descriptor is not touched again
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
  {
    // Counted as the answer starts: a client that has it all must find it counted.
    absl::MutexLock lock(&mu_);
    ++answered_;
  }
  std::string frame = HeaderFrame(header);
  PW_RETURN_IF_ERROR(TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "header"));
  if (r.ok() && !request.status_only()) {
    for (const BufferPtr& b : *r) {
      char* data = b->data();
      const size_t size = static_cast<size_t>(b->byte_size());
      PW_RETURN_IF_ERROR(TransferWhileMoving(fd, data, size, true, timing_.silence, "shard bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pathways
