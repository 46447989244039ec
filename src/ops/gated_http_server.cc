#include "ops/gated_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace pathways {

namespace {

// cpp-httplib hands each accepted connection to its task queue; this one runs the task at once,
// on the accepting thread: all the task does here is give the connection to the polling thread.
class InPlaceQueue : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

bool HeadComplete(const std::string& bytes) { return bytes.find("\r\n\r\n") != std::string::npos; }

// Bytes of the request head, blank line included; beyond `bytes` while it is incomplete.
size_t HeadBytes(const std::string& bytes) {
  const size_t end = bytes.find("\r\n\r\n");
  return end == std::string::npos ? bytes.size() + 1 : end + 4;
}

int MillisecondsUntil(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
                                            60'000));
}

// Waits until `fd` is ready for `events` (or has failed), at most until `deadline`.
bool Ready(int fd, short events, absl::Time deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int timeout = MillisecondsUntil(deadline);
    const int n = poll(&p, 1, timeout);
    if (n > 0) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && timeout > 0 && absl::Now() < deadline) continue;  // woken early by the 60 s cap
    return false;
  }
}

void Address(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  ip.clear();
  port = 0;
  const int got = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length)
                       : getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  if (got != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    port = ntohs(v4->sin_port);
  } else if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    port = ntohs(v6->sin6_port);
  }
  ip = text;
}

// A connection as cpp-httplib reads and writes it while one request is answered: first the bytes
// the polling thread already read (the whole head, at least), then the socket, every wait bounded
// by the request's deadline.
class BufferedSocketStream : public httplib::Stream {
 public:
  BufferedSocketStream(int fd, std::string unread, absl::Time deadline)
      : fd_(fd), unread_(std::move(unread)), deadline_(deadline) {}

  bool is_readable() const override { return offset_ < unread_.size() || Ready(fd_, POLLIN, deadline_); }
  bool is_writable() const override { return Ready(fd_, POLLOUT, deadline_); }

  ssize_t read(char* out, size_t size) override {
    if (offset_ < unread_.size()) {
      const size_t n = std::min(size, unread_.size() - offset_);
      std::memcpy(out, unread_.data() + offset_, n);
      offset_ += n;
      return static_cast<ssize_t>(n);
    }
    for (;;) {
      if (!Ready(fd_, POLLIN, deadline_)) return Fail();
      const ssize_t n = recv(fd_, out, size, MSG_DONTWAIT);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EINTR) return Fail();
    }
  }

  ssize_t write(const char* data, size_t size) override {
    for (;;) {
      if (!Ready(fd_, POLLOUT, deadline_)) return Fail();
      const ssize_t n = send(fd_, data, size, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EINTR) return Fail();
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { Address(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { Address(fd_, false, ip, port); }
  int socket() const override { return fd_; }

  bool failed() const { return failed_; }
  // What was read and not handled: the start of the next request on a kept-alive connection.
  std::string TakeUnread() { return unread_.substr(offset_); }

 private:
  ssize_t Fail() {
    failed_ = true;
    return -1;
  }

  const int fd_;
  std::string unread_;
  size_t offset_ = 0;
  const absl::Time deadline_;
  bool failed_ = false;
};

void Reply(int fd, const char* reply) {
  if (reply != nullptr) (void)send(fd, reply, std::strlen(reply), MSG_DONTWAIT | MSG_NOSIGNAL);
}

constexpr char kTooMany[] =
    "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 29\r\n\r\ntoo many connections, retry\r\n";
constexpr char kTooSlow[] =
    "HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 32\r\n\r\nthe request head came too late\r\n";
constexpr char kTooLarge[] =
    "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 29\r\n\r\n"
    "the request head is too large\r\n";

absl::Duration Seconds(time_t seconds, time_t microseconds) {
  return absl::Seconds(seconds) + absl::Microseconds(microseconds);
}

}  // namespace

GatedHttpServer::GatedHttpServer(HttpGateOptions options)
    : options_(options), wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  new_task_queue = [] { return new InPlaceQueue; };
  poller_ = std::thread([this] { Poll(); });
  for (int i = 0; i < std::max(1, options_.threads); ++i) pool_.emplace_back([this] { Answer(); });
}

GatedHttpServer::~GatedHttpServer() {
  stop();  // no connection is accepted from now on
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof(one));
  poller_.join();  // closes the connections it held
  for (std::thread& t : pool_) t.join();  // each answers its request, at most its deadline
  std::vector<Connection> left;  // queued when stopping: never answered
  {
    absl::MutexLock lock(&mu_);
    for (Connection& c : complete_) left.push_back(std::move(c));
    for (Connection& c : arriving_) left.push_back(std::move(c));
    complete_.clear();
    arriving_.clear();
  }
  for (Connection& c : left) Close(c.fd);
  if (wake_fd_ >= 0) close(wake_fd_);
}

int GatedHttpServer::Bind(const std::string& ip, int port, int backlog) {
  if (port == 0) {
    port = bind_to_any_port(ip);
  } else if (!bind_to_port(ip, port)) {
    port = -1;
  }
  if (port > 0 && ::listen(svr_sock_, backlog) != 0) return -1;  // on Linux, listening again resizes it
  return port > 0 ? port : -1;
}

int GatedHttpServer::open_connections() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

bool GatedHttpServer::process_and_close_socket(int sock) {
  bool admitted = false;
  {
    absl::MutexLock lock(&mu_);
    // Up to twice the bound for a moment: the polling thread then closes the oldest waiting ones.
    if (!stopping_ && open_ < 2 * options_.max_connections) {
      ++open_;
      admitted = true;
    }
  }
  if (admitted) {
    Wait(Connection{sock, "", 0, absl::Now() + Seconds(read_timeout_sec_, read_timeout_usec_)});
    return true;
  }
  Reply(sock, kTooMany);
  shutdown(sock, SHUT_RDWR);
  close(sock);
  return false;
}

void GatedHttpServer::Wait(Connection connection) {
  if (HeadComplete(connection.unread)) {  // a kept-alive client that sent its next request early
    absl::MutexLock lock(&mu_);
    complete_.push_back(std::move(connection));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    arriving_.push_back(std::move(connection));
  }
  const uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof(one));
}

void GatedHttpServer::Close(int fd, const char* reply) {
  Reply(fd, reply);
  shutdown(fd, SHUT_RDWR);
  close(fd);
  absl::MutexLock lock(&mu_);
  --open_;
}

bool GatedHttpServer::ReadHead(Connection& c) {
  char buffer[4096];
  // Reads no further than the head (and what came with it): a client streaming bytes behind its
  // head is read by the request's handling, if at all.
  while (!HeadComplete(c.unread)) {
    const ssize_t n = recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      c.unread.append(buffer, static_cast<size_t>(n));
      if (HeadBytes(c.unread) > options_.max_head_bytes) {
        Close(c.fd, kTooLarge);
        return false;
      }
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    Close(c.fd);  // closed by the client, or failed
    return false;
  }
  return true;
}

// Past max_connections, the connections whose request heads have waited longest make room for
// newcomers: a flood of idle or trickling connections (which must each wait for its head's
// deadline) cannot keep out a client that sends its request at once.
void GatedHttpServer::Evict(std::vector<Connection>& waiting, int excess) {
  const size_t n = std::min(waiting.size(), static_cast<size_t>(excess));
  std::partial_sort(waiting.begin(), waiting.begin() + n, waiting.end(),
                    [](const Connection& a, const Connection& b) { return a.deadline < b.deadline; });
  for (size_t i = 0; i < n; ++i) Close(waiting[i].fd, waiting[i].answered > 0 ? nullptr : kTooMany);
  waiting.erase(waiting.begin(), waiting.begin() + n);
}

void GatedHttpServer::Poll() {
  std::vector<Connection> waiting;
  std::vector<pollfd> polled;
  for (;;) {
    int excess;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      for (Connection& c : arriving_) waiting.push_back(std::move(c));
      arriving_.clear();
      excess = open_ - options_.max_connections;
    }
    if (excess > 0) Evict(waiting, excess);
    absl::Time next = absl::InfiniteFuture();
    polled.assign(1, pollfd{wake_fd_, POLLIN, 0});
    for (const Connection& c : waiting) {
      polled.push_back(pollfd{c.fd, POLLIN, 0});
      next = std::min(next, c.deadline);
    }
    const int timeout = next == absl::InfiniteFuture() ? -1 : MillisecondsUntil(next);
    if (poll(polled.data(), polled.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      // Out of memory for poll's table: what waits is refused rather than left without a deadline.
      for (Connection& c : waiting) Close(c.fd, kTooMany);
      waiting.clear();
      continue;
    }
    if (polled[0].revents != 0) {
      uint64_t count;
      (void)::read(wake_fd_, &count, sizeof(count));
    }
    const absl::Time now = absl::Now();
    std::vector<Connection> still;
    std::vector<Connection> complete;
    for (size_t i = 0; i < waiting.size(); ++i) {
      Connection& c = waiting[i];
      if (polled[i + 1].revents != 0 && !ReadHead(c)) continue;
      if (HeadComplete(c.unread)) {
        complete.push_back(std::move(c));
      } else if (now >= c.deadline) {
        // A kept-alive connection that sent nothing more is simply done with.
        Close(c.fd, c.unread.empty() && c.answered > 0 ? nullptr : kTooSlow);
      } else {
        still.push_back(std::move(c));
      }
    }
    waiting = std::move(still);
    if (!complete.empty()) {
      absl::MutexLock lock(&mu_);
      for (Connection& c : complete) complete_.push_back(std::move(c));
    }
  }
  for (Connection& c : waiting) Close(c.fd);
}

void GatedHttpServer::Answer() {
  for (;;) {
    Connection c;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !complete_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      c = std::move(complete_.front());
      complete_.pop_front();
    }
    const int limit = static_cast<int>(std::max<size_t>(1, keep_alive_max_count_));
    const bool last = c.answered + 1 >= limit;
    BufferedSocketStream stream(c.fd, std::move(c.unread), absl::Now() + Seconds(write_timeout_sec_, write_timeout_usec_));
    bool closed_by_client = false;
    const bool answered = process_request(stream, last, closed_by_client, nullptr);
    if (!answered || closed_by_client || last || stream.failed()) {
      Close(c.fd);
      continue;
    }
    c.unread = stream.TakeUnread();
    c.answered += 1;
    c.deadline = absl::Now() + absl::Seconds(keep_alive_timeout_sec_);
    Wait(std::move(c));
  }
}

}  // namespace pathways
