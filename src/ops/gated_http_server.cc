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
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/executor.h"

namespace pathways {

namespace {

using Clock = GatedHttpServer::Clock;

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

int MillisecondsUntil(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60'000));
}

// Waits until `fd` is ready for `events` (or has failed), at most until `deadline`.
bool Ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    if (Clock::now() >= deadline) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, MillisecondsUntil(deadline));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
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

// A connection as cpp-httplib sees it while one request is answered: reads come first from the
// bytes the polling thread read (the whole head, at least), then from the socket until the
// request's deadline (a body); writes go to memory, for the socket to take later.
class BufferedStream : public httplib::Stream {
 public:
  BufferedStream(int fd, std::string unread, Clock::time_point deadline, size_t max_output)
      : fd_(fd), unread_(std::move(unread)), deadline_(deadline), max_output_(max_output) {}

  bool is_readable() const override { return offset_ < unread_.size() || Ready(fd_, POLLIN, deadline_); }
  bool is_writable() const override { return true; }

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
    if (output_.size() + size > max_output_) return Fail();
    output_.append(data, size);
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { Address(fd_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { Address(fd_, false, ip, port); }
  int socket() const override { return fd_; }

  bool failed() const { return failed_; }
  std::string TakeUnread() { return unread_.substr(offset_); }
  std::string TakeOutput() { return std::move(output_); }

 private:
  ssize_t Fail() {
    failed_ = true;
    return -1;
  }

  const int fd_;
  std::string unread_;
  size_t offset_ = 0;
  const Clock::time_point deadline_;
  const size_t max_output_;
  std::string output_;
  bool failed_ = false;
};

// An answer the gate gives itself, closing the connection.
std::string Refusal(const char* status, const char* why) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: ",
                      std::strlen(why) + 1, "\r\n\r\n", why, "\n");
}
const std::string& TooMany() {
  static const std::string* reply = new std::string(Refusal("503 Service Unavailable", "too many connections"));
  return *reply;
}
const std::string& TooSlow() {
  static const std::string* reply = new std::string(Refusal("408 Request Timeout", "the request head came too late"));
  return *reply;
}
const std::string& TooLarge() {
  static const std::string* reply =
      new std::string(Refusal("431 Request Header Fields Too Large", "the request head is too large"));
  return *reply;
}

void Send(int fd, const std::string& reply) {
  (void)send(fd, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

Clock::time_point After(time_t seconds, time_t microseconds = 0) {
  return Clock::now() + std::chrono::seconds(seconds) + std::chrono::microseconds(microseconds);
}

}  // namespace

GatedHttpServer::GatedHttpServer(HttpGateOptions options)
    : options_(options), wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  new_task_queue = [] { return new InPlaceQueue; };
  poller_ = std::thread([this] {
    NameThisThread("http-poll");
    Poll();
  });
  for (int i = 0; i < std::max(1, options_.threads); ++i) {
    pool_.emplace_back([this] {
      NameThisThread("http-answer");
      Answer();
    });
  }
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
  for (std::thread& t : pool_) t.join();  // each finishes its answer: handlers do not wait for clients
  std::vector<Connection> left;  // handed over while stopping
  {
    absl::MutexLock lock(&mu_);
    for (Connection& c : complete_) left.push_back(std::move(c));
    for (Connection& c : arriving_) left.push_back(std::move(c));
    complete_.clear();
    arriving_.clear();
  }
  for (Connection& c : left) Close(c);
  if (wake_fd_ >= 0) close(wake_fd_);
}

int GatedHttpServer::Bind(const std::string& ip, int port, int backlog) {
  if (port == 0) {
    port = bind_to_any_port(ip);
  } else if (!bind_to_port(ip, port)) {
    port = -1;
  }
  if (port <= 0) return -1;
  if (::listen(svr_sock_, backlog) != 0) {  // on Linux, listening again resizes the backlog
    ::close(svr_sock_.exchange(INVALID_SOCKET));
    return -1;
  }
  return port;
}

int GatedHttpServer::open_connections() const {
  absl::MutexLock lock(&mu_);
  return open_;
}

bool GatedHttpServer::process_and_close_socket(int sock) {
  bool admitted = false;
  {
    absl::MutexLock lock(&mu_);
    // Up to twice the bound for a moment: the polling thread then closes the longest waiting.
    if (!stopping_ && open_ < 2 * options_.max_connections) {
      ++open_;
      admitted = true;
    }
  }
  if (!admitted) {
    Send(sock, TooMany());
    shutdown(sock, SHUT_RDWR);
    close(sock);
    return false;
  }
  Connection c;
  c.fd = sock;
  c.deadline = After(read_timeout_sec_, read_timeout_usec_);
  Wait(std::move(c));
  return true;
}

void GatedHttpServer::Wait(Connection c) {
  const bool sending = c.sent < c.output.size();
  if (!sending && HeadBytes(c.unread) > options_.max_head_bytes) {  // came with the last request
    Close(c, TooLarge().c_str());
    return;
  }
  if (!sending && HeadComplete(c.unread)) {  // sent early, with the last request
    absl::MutexLock lock(&mu_);
    complete_.push_back(std::move(c));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    arriving_.push_back(std::move(c));
  }
  const uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof(one));
}

void GatedHttpServer::Close(Connection& c, const char* reply) {
  if (reply != nullptr) Send(c.fd, reply);
  shutdown(c.fd, SHUT_RDWR);
  close(c.fd);
  c.fd = -1;
  c.output.clear();
  c.sent = 0;
  absl::MutexLock lock(&mu_);
  --open_;
  unsent_ -= std::exchange(c.charged, 0);
}

bool GatedHttpServer::ReadHead(Connection& c) {
  char buffer[4096];
  // Reads no further than the head (and what came with it): a body is read by the request's
  // handling, if at all.
  while (!HeadComplete(c.unread)) {
    const ssize_t n = recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      // A kept connection idles up to the keep-alive timeout; its next head then has the read
      // timeout, from its first byte.
      if (c.unread.empty() && c.answered > 0) c.deadline = After(read_timeout_sec_, read_timeout_usec_);
      c.unread.append(buffer, static_cast<size_t>(n));
      if (HeadBytes(c.unread) > options_.max_head_bytes) {
        Close(c, TooLarge().c_str());
        return false;
      }
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    Close(c);  // closed by the client, or failed
    return false;
  }
  return true;
}

bool GatedHttpServer::SendSome(Connection& c) {
  while (c.sent < c.output.size()) {
    const ssize_t n = send(c.fd, c.output.data() + c.sent, c.output.size() - c.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      c.sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    Close(c);
    return false;
  }
  return true;
}

void GatedHttpServer::AfterAnswer(Connection c) {
  if (c.charged > 0) {
    absl::MutexLock lock(&mu_);
    unsent_ -= std::exchange(c.charged, 0);
  }
  c.output.clear();
  c.sent = 0;
  if (c.close_after) {
    Close(c);
    return;
  }
  c.deadline = After(keep_alive_timeout_sec_);
  Wait(std::move(c));
}

// Past max_connections, the connections with the nearest deadlines (those that have waited
// longest for a head, or for their answer to be read) make room for newcomers: a flood of slow
// connections cannot keep out a client that sends its request and reads its answer at once.
void GatedHttpServer::Evict(std::vector<Connection>& waiting, int excess) {
  const size_t n = std::min(waiting.size(), static_cast<size_t>(excess));
  std::partial_sort(waiting.begin(), waiting.begin() + n, waiting.end(),
                    [](const Connection& a, const Connection& b) { return a.deadline < b.deadline; });
  for (size_t i = 0; i < n; ++i) {
    Connection& c = waiting[i];
    const bool new_head = c.answered == 0 && c.output.empty();
    Close(c, new_head ? TooMany().c_str() : nullptr);  // an answer under way cannot be replaced
  }
  waiting.erase(waiting.begin(), waiting.begin() + n);
}

void GatedHttpServer::Poll() {
  std::vector<Connection> waiting;
  std::vector<pollfd> polled;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      for (Connection& c : arriving_) waiting.push_back(std::move(c));
      arriving_.clear();
    }
    Clock::time_point next = Clock::time_point::max();
    polled.assign(1, pollfd{wake_fd_, POLLIN, 0});
    for (const Connection& c : waiting) {
      polled.push_back(pollfd{c.fd, static_cast<short>(c.sent < c.output.size() ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    int timeout = next == Clock::time_point::max() ? -1 : MillisecondsUntil(next);
    if (wake_fd_ < 0 && (timeout < 0 || timeout > 50)) timeout = 50;  // no eventfd: look for arrivals
    if (poll(polled.data(), polled.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      // Out of memory for poll's table: what waits is refused rather than left without a deadline.
      for (Connection& c : waiting) Close(c, TooMany().c_str());
      waiting.clear();
      continue;
    }
    if (polled[0].revents != 0) {
      uint64_t count;
      (void)::read(wake_fd_, &count, sizeof(count));
    }
    const Clock::time_point now = Clock::now();
    std::vector<Connection> still;
    std::vector<Connection> complete;
    for (size_t i = 0; i < waiting.size(); ++i) {
      Connection& c = waiting[i];
      const bool ready = polled[i + 1].revents != 0;
      if (c.sent < c.output.size()) {
        if (ready && !SendSome(c)) continue;
        if (c.sent == c.output.size()) {
          AfterAnswer(std::move(c));  // back here through `arriving_`, unless it closes
        } else if (now >= c.deadline) {
          // Its client did not read the answer in time: reset, which also drops what the kernel
          // still holds of the answer.
          const linger reset{1, 0};
          setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
          Close(c);
        } else {
          still.push_back(std::move(c));
        }
        continue;
      }
      if (ready && !ReadHead(c)) continue;
      if (HeadComplete(c.unread)) {
        complete.push_back(std::move(c));
      } else if (now >= c.deadline) {
        // A kept connection that sent nothing more is simply done with.
        Close(c, c.unread.empty() && c.answered > 0 ? nullptr : TooSlow().c_str());
      } else {
        still.push_back(std::move(c));
      }
    }
    int excess;
    {
      absl::MutexLock lock(&mu_);
      excess = open_ - options_.max_connections;
    }
    if (excess > 0) Evict(still, excess);
    waiting = std::move(still);
    if (!complete.empty()) {
      absl::MutexLock lock(&mu_);
      for (Connection& c : complete) complete_.push_back(std::move(c));
    }
  }
  for (Connection& c : waiting) Close(c);
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
    BufferedStream stream(c.fd, std::move(c.unread), After(read_timeout_sec_, read_timeout_usec_),
                          options_.max_answer_bytes);
    const bool last = c.answered + 1 >= std::max<size_t>(1, keep_alive_max_count_);
    bool closed_by_client = false;
    bool has_body = false;  // its body may be left unread: the connection cannot go on
    const bool answered = process_request(stream, last, closed_by_client, [&has_body](httplib::Request& request) {
      has_body = request.has_header("Transfer-Encoding") ||
                 (request.has_header("Content-Length") && request.get_header_value("Content-Length") != "0");
    });
    if (!answered || stream.failed()) {
      Close(c);
      continue;
    }
    c.unread = stream.TakeUnread();
    c.output = stream.TakeOutput();
    c.sent = 0;
    c.answered += 1;
    c.close_after = closed_by_client || last || has_body;
    if (!SendSome(c)) continue;
    if (c.sent == c.output.size()) {
      AfterAnswer(std::move(c));
      continue;
    }
    // The rest is for the polling thread to send as the client reads it, within the budget.
    const size_t rest = c.output.size() - c.sent;
    bool room;
    {
      absl::MutexLock lock(&mu_);
      room = unsent_ + rest <= options_.max_unsent_bytes;
      if (room) unsent_ += rest;
    }
    if (!room) {
      Close(c);
      continue;
    }
    c.charged = rest;
    c.deadline = After(write_timeout_sec_, write_timeout_usec_);
    Wait(std::move(c));
  }
}

}  // namespace pathways
