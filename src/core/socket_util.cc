#include "core/socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {

int RemainingMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

std::string Errno(int err) { return std::strerror(err); }

void Configure(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

namespace {

// Moves [data, data+len) before `deadline`, which moves `silence` on whenever bytes move (when
// `silence` is not infinite), never past `by`.
absl::Status Transfer(int fd, char* data, size_t len, bool write, absl::Time deadline, absl::Duration silence,
                      const std::string& what, absl::Time by = absl::InfiniteFuture()) {
  deadline = std::min(deadline, by);
  size_t done = 0;
  while (done < len) {
    ssize_t n = write ? send(fd, data + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                      : recv(fd, data + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      if (silence != absl::InfiniteDuration()) deadline = std::min(absl::Now() + silence, by);
      continue;
    }
    if (n == 0) return absl::UnavailableError(absl::StrCat(what, ": connection closed"));
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return absl::UnavailableError(absl::StrCat(what, ": ", Errno(errno)));
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int ms = RemainingMs(deadline);
    if (ms == 0 || poll(&p, 1, ms) == 0) return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TransferAll(int fd, char* data, size_t len, bool write, absl::Time deadline, const std::string& what) {
  return Transfer(fd, data, len, write, deadline, absl::InfiniteDuration(), what);
}

absl::Status TransferWhileMoving(int fd, char* data, size_t len, bool write, absl::Duration silence,
                                 const std::string& what, absl::Time by) {
  return Transfer(fd, data, len, write, absl::Now() + silence, silence, what, by);
}

absl::Status ReadFrameWhileMoving(int fd, std::string& into, size_t len, absl::Duration silence,
                                  const std::string& what) {
  constexpr size_t kPiece = size_t{1} << 20;
  if (into.capacity() > 4 * kPiece && len <= kPiece) std::string().swap(into);
  into.clear();
  while (into.size() < len) {
    const size_t at = into.size();
    const size_t n = std::min(len - at, kPiece);
    into.resize(at + n);
    PW_RETURN_IF_ERROR(TransferWhileMoving(fd, into.data() + at, n, false, silence, what));
  }
  return absl::OkStatus();
}

void KeepAlive(int fd, int idle_ms) {
  const int on = 1;
  const int idle_s = std::max(1, idle_ms / 1000);
  const int interval_s = std::max(1, idle_ms / 2000);
  const int probes = 3;
  // At least the streams' own 30 s bound on a frame that stops halfway: a receiver whose window
  // stays closed this long (since Linux 5.11 that aborts too) is frozen or far too slow.
  const unsigned int user_timeout_ms = static_cast<unsigned int>(std::max(30'000, idle_ms * 5));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

namespace {

// POLLRDHUP: the peer's FIN came, even with bytes it sent before still unread (a peek would see
// those bytes and take the connection for alive: a collective peer that wrote its message and
// then gave up on the call leaves exactly that).
constexpr short kClosedEvents = POLLIN | POLLRDHUP;
bool Closed(const pollfd& p) { return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0; }

}  // namespace

bool PeerClosed(int fd) {
  pollfd p{fd, kClosedEvents, 0};
  if (poll(&p, 1, 0) < 0) return errno != EINTR;
  return Closed(p);
}

std::vector<bool> PeersClosed(absl::Span<const int> fds) {
  std::vector<pollfd> polled(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) polled[i] = {fds[i], kClosedEvents, 0};  // poll() skips fds < 0
  std::vector<bool> closed(fds.size(), false);
  if (poll(polled.data(), polled.size(), 0) < 0) {
    // Interrupted: nothing is known closed. Any other failure: each connection taken for broken.
    if (errno != EINTR) {
      for (size_t i = 0; i < fds.size(); ++i) closed[i] = fds[i] >= 0;
    }
    return closed;
  }
  for (size_t i = 0; i < fds.size(); ++i) closed[i] = fds[i] >= 0 && Closed(polled[i]);
  return closed;
}

std::string HostOfAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon == std::string::npos ? 0 : colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

absl::StatusOr<sockaddr_storage> ParseAddress(const std::string& address, socklen_t* len) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad address '", address, "'"));
  }
  const std::string ip = HostOfAddress(address);
  sockaddr_storage storage{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in6);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("bad address '", address, "'"));
  }
  return storage;
}

}  // namespace pathways
