#include "worker/data_stream_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// kHeader, its length, the header.
std::string HeaderFrame(const rpc::StreamHeader& header) {
  const std::string body = header.SerializeAsString();
  return absl::StrCat(std::string(1, kStreamHeader), EncodeStreamU32(static_cast<uint32_t>(body.size())), body);
}

// A header that carries `status` (and nothing else yet).
rpc::StreamHeader StatusHeader(const absl::Status& status) {
  rpc::StreamHeader header;
  header.set_code(static_cast<int>(status.code()));
  header.set_message(std::string(status.message()));
  return header;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataStreamServer>> DataStreamServer::Start(const std::string& ip, std::string token,
                                                                          std::string also, Handlers handlers,
                                                                          DataStreamTiming timing, int port,
                                                                          int max_connections) {
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage at, ParseAddress(absl::StrCat(ip, ":1"), &length));
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("data stream port ", port));
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
    return absl::UnavailableError(absl::StrCat("data stream cannot listen on ", ip, ": ", Errno(error)));
  }
  port = at.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&at)->sin_port)
                                 : ntohs(reinterpret_cast<sockaddr_in6*>(&at)->sin6_port);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("data stream: eventfd: ", Errno(errno)));
  }
  return std::unique_ptr<DataStreamServer>(
      new DataStreamServer(fd, port, wake, std::move(token), std::move(also), std::move(handlers), timing,
                           max_connections));
}

DataStreamServer::DataStreamServer(int listen_fd, int port, int wake_fd, std::string token, std::string also,
                                   Handlers handlers, DataStreamTiming timing, int max_connections)
    : listen_fd_(listen_fd),
      port_(port),
      wake_fd_(wake_fd),
      token_(std::move(token)),
      also_(std::move(also)),
      handlers_(std::move(handlers)),
      timing_(timing),
      max_connections_(max_connections) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

DataStreamServer::~DataStreamServer() {
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

int64_t DataStreamServer::answered() const {
  absl::MutexLock lock(&mu_);
  return answered_;
}

bool DataStreamServer::stopping() const {
  absl::MutexLock lock(&mu_);
  return stop_;
}

// A connection whose hello has not all come yet: it waits in the acceptor's poll set, holding a
// descriptor but no thread, until the hello is complete (then it gets a thread), wrong, or late.
struct DataStreamServer::Greeting {
  int fd;
  absl::Time deadline;
  std::string hello;  // what has come so far
  size_t want = 12;   // the magic and the token's length; then the token too
  absl::Status refused;  // why the token is not accepted
};

DataStreamServer::Heard DataStreamServer::Listen(Greeting& g) {
  while (g.hello.size() < g.want) {
    char buffer[512];
    // Exactly the hello: the request after it is the connection thread's to read.
    const ssize_t n = recv(g.fd, buffer, std::min(sizeof(buffer), g.want - g.hello.size()), 0);
    if (n == 0) return Heard::kBad;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Heard::kMore : Heard::kBad;
    g.hello.append(buffer, static_cast<size_t>(n));
    if (g.want == 12 && g.hello.size() == 12) {
      if (std::memcmp(g.hello.data(), kDataStreamMagic, 8) != 0) return Heard::kBad;
      const uint32_t length = DecodeStreamU32(g.hello.data() + 8);
      if (length > kMaxStreamTokenBytes) return Heard::kBad;
      g.want = 12 + length;
    }
  }
  g.refused = CheckToken(g.hello.substr(12), token_, also_);
  return g.refused.ok() ? Heard::kHello : Heard::kWrongToken;
}

void DataStreamServer::AcceptLoop() {
  std::deque<Greeting> greeting;  // oldest first: their deadlines are in this order
  auto drop = [](Greeting& g) { close(g.fd); };
  while (true) {
    std::vector<pollfd> polled = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    for (const Greeting& g : greeting) polled.push_back({g.fd, POLLIN, 0});
    const int timeout = greeting.empty() ? -1 : RemainingMs(greeting.front().deadline);
    if (poll(polled.data(), polled.size(), timeout) < 0 && errno != EINTR) break;
    if (polled[1].revents != 0) break;
    std::deque<Greeting> still;
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < greeting.size(); ++i) {
      Greeting& g = greeting[i];
      const Heard heard = polled[2 + i].revents != 0 ? Listen(g) : Heard::kMore;
      if (heard == Heard::kHello) {
        Admit(g.fd);
      } else if (heard == Heard::kWrongToken) {
        TurnAway(g.fd, g.refused, /*not_served=*/false);
      } else if (heard == Heard::kBad || now >= g.deadline) {
        drop(g);  // garbage, closed, or silent past the connect bound
      } else {
        still.push_back(std::move(g));
      }
    }
    greeting = std::move(still);
    if ((polled[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors or over the port's cap (core/process.cc): the connection may stay
      // queued, and poll() would return at once.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    Configure(fd);
    if (greeting.size() >= kMaxGreeting) {
      drop(greeting.front());  // the oldest silent one makes room
      greeting.pop_front();
    }
    greeting.push_back({fd, absl::Now() + timing_.connect});
  }
  for (Greeting& g : greeting) drop(g);
}

void DataStreamServer::Admit(int fd) {
  std::list<Connection> finished;
  bool served = false;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (it->finished) finished.splice(finished.end(), connections_, it);
      it = next;
    }
    if (!stop_ && static_cast<int>(connections_.size()) < max_connections_) {
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
  if (!served) TurnAway(fd, absl::UnavailableError("its data streams are all taken"), /*not_served=*/true);
  for (Connection& c : finished) c.thread.join();  // threads that have ended
}

// The client hears why its connection is refused (full: then `not_served`, and it uses gRPC
// instead), without this thread waiting on it. The connection is closed at once (its request is
// read first if it came, so the close does not reset the answer away; a client that sees a reset
// anyway also takes gRPC).
void DataStreamServer::TurnAway(int fd, const absl::Status& why, bool not_served) {
  rpc::StreamHeader header = StatusHeader(why);
  header.set_not_served(not_served);
  std::string frame = HeaderFrame(header);
  (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  shutdown(fd, SHUT_WR);
  char sink[4096];
  (void)!recv(fd, sink, sizeof(sink), MSG_DONTWAIT);  // one read, bounded: a request
  close(fd);
}

absl::Status DataStreamServer::SendStatus(int fd, const absl::Status& why) {
  std::string frame = HeaderFrame(StatusHeader(why));
  return TransferAll(fd, frame.data(), frame.size(), true, absl::Now() + timing_.silence, "refusal");
}

void DataStreamServer::Serve(Connection* c) {
  const int fd = c->fd;  // its hello was checked before it got this thread
  absl::Status s;
  while (s.ok()) {
    pollfd polled[2] = {{fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const int ready = poll(polled, 2, static_cast<int>(absl::ToInt64Milliseconds(kIdle)));
    if (ready <= 0 || polled[1].revents != 0 || (polled[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) break;
    const absl::Time deadline = absl::Now() + timing_.silence;
    char length[4];
    s = TransferAll(fd, length, 4, false, deadline, "request");
    if (!s.ok()) break;
    const uint32_t bytes = DecodeStreamU32(length);
    if (bytes > kMaxStreamRequestBytes) {
      (void)SendStatus(fd, absl::InvalidArgumentError(absl::StrCat("a data stream request of ", bytes, " bytes (at most ",
                                                               kMaxStreamRequestBytes, ")")));
      break;
    }
    std::string body(bytes, '\0');
    s = TransferAll(fd, body.data(), bytes, false, deadline, "request");
    if (!s.ok()) break;
    rpc::StreamRequest request;
    if (!request.ParseFromString(body) || request.kind_case() == rpc::StreamRequest::KIND_NOT_SET) {
      // Bytes may follow it (a stage request's): the stream is at an unknown place, so it closes.
      (void)SendStatus(fd, absl::InvalidArgumentError("a data stream request that does not parse"));
      break;
    }
    if (request.has_stage()) {
      // Its bytes follow: a refused one leaves the stream at an unknown place, so it closes.
      s = AnswerStage(fd, request.stage());
      continue;
    }
    const rpc::FetchRequest& fetch = request.fetch();
    if (absl::Status client = CheckClientCredential(fetch.client_id(), fetch.credential()); !client.ok()) {
      s = SendStatus(fd, client);
      continue;
    }
    s = AnswerFetch(fd, fetch);
  }
  absl::MutexLock lock(&mu_);
  close(fd);
  c->finished = true;  // its descriptor is not touched again
}

absl::Status DataStreamServer::AnswerStage(int fd, const rpc::StageRequest& request) {
  const absl::Status client = CheckClientCredential(request.client_id(), request.credential());
  absl::StatusOr<BufferPtr> landing = client.ok() ? handlers_.land(request) : client;
  if (!landing.ok()) {
    (void)SendStatus(fd, landing.status());
    return absl::Status(landing.status().code(), "refused before its bytes");  // the connection closes
  }
  BufferPtr buffer = *std::move(landing);
  PW_RETURN_IF_ERROR(TransferWhileMoving(fd, buffer->data(), static_cast<size_t>(buffer->byte_size()), false,
                                         timing_.silence, "staged bytes"));
  absl::Status kept = handlers_.keep(request, std::move(buffer));
  {
    absl::MutexLock lock(&mu_);
    ++answered_;
  }
  return SendStatus(fd, kept);  // OK, or why the bytes are not kept
}

absl::Status DataStreamServer::AnswerFetch(int fd, const rpc::FetchRequest& request) {
  Future<std::vector<BufferPtr>> buffers = handlers_.fetch(request);
  // While the data is not ready the client hears that this worker is alive, and a client that
  // went away is noticed.
  const char waiting = kStreamWaiting;
  while (!buffers.IsReady()) {
    (void)buffers.AwaitFor(timing_.keepalive);
    if (buffers.IsReady()) break;
    if (stopping()) return absl::CancelledError("the worker is stopping");
    PW_RETURN_IF_ERROR(TransferAll(fd, const_cast<char*>(&waiting), 1, true, absl::Now() + timing_.silence, "keepalive"));
  }
  const absl::StatusOr<std::vector<BufferPtr>>& r = buffers.Await();
  rpc::StreamHeader header = StatusHeader(r.status());
  if (r.ok() && !request.status_only()) {
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
