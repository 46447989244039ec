#include "transport/stream_listener.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

std::string EncodeStreamU32(uint32_t v) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

uint32_t DecodeStreamU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

std::string StreamHeaderFrame(const rpc::StreamHeader& header) {
  const std::string body = header.SerializeAsString();
  return absl::StrCat(std::string(1, kStreamHeader), EncodeStreamU32(static_cast<uint32_t>(body.size())), body);
}

std::string StreamStatusFrame(const absl::Status& status) {
  rpc::StreamHeader header;
  header.set_code(static_cast<int>(status.code()));
  header.set_message(std::string(status.message()));
  return StreamHeaderFrame(header);
}

absl::Status HeaderStatus(const rpc::StreamHeader& header) {
  const int code = header.code();
  if (code == 0) return absl::OkStatus();
  return absl::Status(code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown,
                      header.message());
}

void TurnAwayStream(int fd, const absl::Status& why, bool not_served) {
  rpc::StreamHeader header;
  header.set_code(static_cast<int>(why.code()));
  header.set_message(std::string(why.message()));
  header.set_not_served(not_served);
  std::string frame = StreamHeaderFrame(header);
  (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  shutdown(fd, SHUT_WR);
  // One read, bounded: a request that came after the hello, so the close does not reset the
  // answer away.
  char sink[4096];
  (void)!recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
  close(fd);
}

absl::StatusOr<rpc::StreamHeader> ReadStreamHeader(int fd, absl::Duration silence, const std::string& what) {
  char start[5];
  PW_RETURN_IF_ERROR(TransferWhileMoving(fd, start, 5, false, silence, what));
  if (start[0] != kStreamHeader) return absl::DataLossError(absl::StrCat(what, ": a byte that starts no header"));
  const uint32_t bytes = DecodeStreamU32(start + 1);
  if (bytes > kMaxStreamHeaderBytes) return absl::DataLossError(absl::StrCat(what, ": a header of ", bytes, " bytes"));
  std::string body(bytes, '\0');
  PW_RETURN_IF_ERROR(TransferWhileMoving(fd, body.data(), bytes, false, silence, what));
  rpc::StreamHeader header;
  if (!header.ParseFromString(body)) return absl::DataLossError(absl::StrCat(what, ": a header that does not parse"));
  return header;
}

bool PlainControlStreams() {
  if (TlsConfigured()) return false;
  const char* env = std::getenv("PATHWAYS_PLAIN_STREAMS");
  return env == nullptr || std::string(env) != "0";
}

absl::StatusOr<int> DialStream(const std::string& what, const std::string& ip, int port, const std::string& magic,
                               const std::string& token, absl::Duration timeout) {
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage to, ParseAddress(absl::StrCat(ip, ":", port), &length));
  const int fd = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(what, ": ", Errno(errno)));
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status s;
  if (connect(fd, reinterpret_cast<sockaddr*>(&to), length) != 0) {
    if (errno != EINPROGRESS) {
      s = absl::UnavailableError(absl::StrCat(what, ": connecting: ", Errno(errno)));
    } else {
      pollfd p{fd, POLLOUT, 0};
      int error = 0;
      socklen_t error_length = sizeof(error);
      int polled;
      while ((polled = poll(&p, 1, RemainingMs(deadline))) < 0 && errno == EINTR) {
      }
      if (polled == 0) {
        s = absl::UnavailableError(absl::StrCat(what, ": connecting timed out"));
      } else if (polled < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &error_length) != 0) {
        s = absl::UnavailableError(absl::StrCat(what, ": connecting: ", Errno(errno)));
      } else if (error != 0) {
        s = absl::UnavailableError(absl::StrCat(what, ": connecting: ", Errno(error)));
      }
    }
  }
  if (s.ok()) {
    Configure(fd);
    KeepAlive(fd, KeepaliveMs());
    std::string hello = absl::StrCat(magic.substr(0, kStreamMagicBytes),
                                     EncodeStreamU32(static_cast<uint32_t>(token.size())), token);
    s = TransferAll(fd, hello.data(), hello.size(), true, deadline, absl::StrCat(what, ": hello"));
  }
  if (!s.ok()) {
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<StreamListener>> StreamListener::Start(const std::string& what, const std::string& ip,
                                                                      int port, std::vector<Protocol> protocols,
                                                                      absl::Duration connect, int max_connections) {
  bool frames = false;
  for (const Protocol& p : protocols) {
    if (p.magic.size() != kStreamMagicBytes || !p.serve == !p.frame || (p.frame && p.max_frame == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a protocol without an 8-byte magic, or without one of a server and a frame reader"));
    }
    frames = frames || p.frame != nullptr;
  }
  socklen_t length = 0;
  PW_ASSIGN_OR_RETURN(sockaddr_storage at, ParseAddress(absl::StrCat(ip, ":1"), &length));
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat(what, " port ", port));
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
    return absl::UnavailableError(absl::StrCat(what, " cannot listen on ", ip, ": ", Errno(error)));
  }
  port = at.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&at)->sin_port)
                                 : ntohs(reinterpret_cast<sockaddr_in6*>(&at)->sin6_port);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  const int epoll = frames ? epoll_create1(EPOLL_CLOEXEC) : -1;
  epoll_event woken{EPOLLIN, {.ptr = nullptr}};  // the stop: readable once set, never read
  if (wake < 0 || (frames && (epoll < 0 || epoll_ctl(epoll, EPOLL_CTL_ADD, wake, &woken) != 0))) {
    const int error = errno;
    close(fd);
    if (wake >= 0) close(wake);
    if (epoll >= 0) close(epoll);
    return absl::UnavailableError(absl::StrCat(what, ": eventfd or epoll: ", Errno(error)));
  }
  return std::unique_ptr<StreamListener>(
      new StreamListener(fd, port, wake, epoll, std::move(protocols), connect, max_connections));
}

StreamListener::StreamListener(int listen_fd, int port, int wake_fd, int epoll_fd, std::vector<Protocol> protocols,
                               absl::Duration connect, int max_connections)
    : listen_fd_(listen_fd),
      port_(port),
      wake_fd_(wake_fd),
      protocols_(std::move(protocols)),
      connect_(connect),
      max_connections_(max_connections),
      epoll_fd_(epoll_fd) {
  acceptor_ = std::thread([this] {
    NameThisThread("stream-accept");
    AcceptLoop();
  });
  if (epoll_fd_ >= 0) {
    reader_ = std::thread([this] {
      NameThisThread("stream-read");
      ReadLoop();
    });
  }
}

StreamListener::~StreamListener() {
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
  if (reader_.joinable()) reader_.join();
  {
    absl::MutexLock lock(&mu_);
    connections.splice(connections.end(), connections_);
    while (!readers_.empty()) CloseReader(*readers_.begin());
  }
  for (Connection& c : connections) c.thread.join();
  close(listen_fd_);
  close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

bool StreamListener::stopping() const {
  absl::MutexLock lock(&mu_);
  return stop_;
}

// A connection whose hello has not all come yet: it waits in the acceptor's poll set, holding a
// descriptor but no thread, until the hello is complete (then it gets a thread), wrong, or late.
struct StreamListener::Greeting {
  int fd;
  absl::Time deadline;
  std::string hello;                  // what has come so far
  size_t want = kStreamMagicBytes + 4;  // the magic and the token's length; then the token too
  const Protocol* protocol = nullptr;
  absl::Status refused;  // why the token is not accepted
  std::string tenant;    // whose it is, when it is
};

StreamListener::Heard StreamListener::Listen(Greeting& g) {
  constexpr size_t kStart = kStreamMagicBytes + 4;
  while (g.hello.size() < g.want) {
    char buffer[512];
    // Exactly the hello: what follows is the connection thread's to read.
    const ssize_t n = recv(g.fd, buffer, std::min(sizeof(buffer), g.want - g.hello.size()), 0);
    if (n == 0) return Heard::kBad;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Heard::kMore : Heard::kBad;
    g.hello.append(buffer, static_cast<size_t>(n));
    if (g.want == kStart && g.hello.size() == kStart) {
      for (const Protocol& p : protocols_) {
        if (std::memcmp(g.hello.data(), p.magic.data(), kStreamMagicBytes) == 0) g.protocol = &p;
      }
      if (g.protocol == nullptr) return Heard::kBad;
      const uint32_t length = DecodeStreamU32(g.hello.data() + kStreamMagicBytes);
      if (length > kMaxStreamTokenBytes) return Heard::kBad;
      g.want = kStart + length;
    }
  }
  absl::StatusOr<std::string> tenant =
      TokenTenant(std::string_view(g.hello).substr(kStart), g.protocol->token, g.protocol->also);
  if (!tenant.ok()) {
    g.refused = tenant.status();
    return Heard::kWrongToken;
  }
  g.tenant = *std::move(tenant);
  return Heard::kHello;
}

void StreamListener::AcceptLoop() {
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
        Admit(g.fd, g.protocol, std::move(g.tenant));
      } else if (heard == Heard::kWrongToken) {
        TurnAwayStream(g.fd, g.refused, /*not_served=*/false);
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
    KeepAlive(fd, KeepaliveMs());
    if (greeting.size() >= kMaxGreeting) {
      drop(greeting.front());  // the oldest silent one makes room
      greeting.pop_front();
    }
    greeting.push_back({fd, absl::Now() + connect_});
  }
  for (Greeting& g : greeting) drop(g);
}

// A connection of a protocol of frames: what has come of its frame in progress.
struct StreamListener::FrameReader {
  int fd;
  const Protocol* protocol;
  std::string buffer;     // [0, filled): bytes read and not yet handed over, the start of a frame
  size_t filled = 0;      // (the rest is room, kept: not cleared before each read)
  absl::Time progress;    // when a byte last came
  absl::Time last_frame;  // when a frame was last handed over (or the connection admitted)
};

void StreamListener::Admit(int fd, const Protocol* protocol, std::string tenant) {
  std::list<Connection> finished;
  bool served = false;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (it->finished) finished.splice(finished.end(), connections_, it);
      it = next;
    }
    const int cap = protocol->max_connections > 0 ? protocol->max_connections : max_connections_;
    int of_protocol = 0;
    for (const Connection& c : connections_) of_protocol += c.protocol == protocol ? 1 : 0;
    for (const FrameReader* c : readers_) of_protocol += c->protocol == protocol ? 1 : 0;
    if (!stop_ && of_protocol < cap && protocol->frame) {
      // A fresh connection's socket buffer takes the few bytes of the admission at once.
      const std::string admitted = StreamStatusFrame(absl::OkStatus());
      const absl::Time now = absl::Now();
      auto c = std::make_unique<FrameReader>(FrameReader{fd, protocol, "", 0, now, now});
      epoll_event event{EPOLLIN | EPOLLRDHUP, {.ptr = c.get()}};
      if (send(fd, admitted.data(), admitted.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
              static_cast<ssize_t>(admitted.size()) &&
          epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) == 0) {
        readers_.insert(c.release());
      } else {
        close(fd);
      }
      served = true;  // (or closed: a peer that cannot take 7 bytes is gone)
    } else if (!stop_ && of_protocol < cap) {
      connections_.push_back({fd, protocol, {}, false});
      Connection* c = &connections_.back();
      try {
        c->thread = std::thread([this, c, protocol, tenant = std::move(tenant)] {
          NameThisThread("stream-conn");
          protocol->serve(c->fd, *this, tenant);
          absl::MutexLock lock(&mu_);
          close(c->fd);
          c->finished = true;  // its descriptor is not touched again
        });
        served = true;
      } catch (const std::system_error&) {
        connections_.pop_back();  // no thread to be had
      }
    }
  }
  if (!served) TurnAwayStream(fd, absl::UnavailableError("its streams are all taken"), /*not_served=*/true);
  for (Connection& c : finished) c.thread.join();  // threads that have ended
}

void StreamListener::CloseReader(FrameReader* c) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  close(c->fd);
  readers_.erase(c);
  delete c;
}

bool StreamListener::ReadFrames(FrameReader& c, absl::Time now) {
  const Protocol& p = *c.protocol;
  // At most this much a turn, so that one busy sender does not hold the others' batches.
  constexpr size_t kTurn = 1 << 20;
  constexpr size_t kChunk = 64 << 10;
  for (size_t taken = 0; taken < kTurn;) {
    // Room for a chunk, or, for a large frame in progress, room that doubles as its bytes come,
    // up to its length: a sender that declares a large frame and stalls holds little memory.
    size_t need = c.filled + kChunk;
    if (c.filled >= 4) {
      const size_t frame = 4 + size_t{DecodeStreamU32(c.buffer.data())};
      need = std::max(need, std::min(frame, 2 * c.filled));
    }
    if (c.buffer.size() < need) c.buffer.resize(need);
    const size_t room = c.buffer.size() - c.filled;
    const ssize_t n = recv(c.fd, c.buffer.data() + c.filled, room, 0);
    if (n == 0) return false;  // closed (between frames: done; within one: it is written again)
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    taken += static_cast<size_t>(n);
    c.filled += static_cast<size_t>(n);
    c.progress = now;
    size_t at = 0;
    while (c.filled - at >= 4) {
      const uint32_t bytes = DecodeStreamU32(c.buffer.data() + at);
      if (bytes > p.max_frame) {
        PW_LOG(Error) << "stream " << p.magic << ": a frame of " << bytes << " bytes (at most " << p.max_frame
                      << "); the connection closes";
        return false;
      }
      if (c.filled - at - 4 < bytes) break;
      if (!p.frame(c.buffer.data() + at + 4, bytes)) return false;
      at += 4 + size_t{bytes};
      c.last_frame = now;
    }
    if (at > 0) {
      std::memmove(c.buffer.data(), c.buffer.data() + at, c.filled - at);
      c.filled -= at;
    }
    // A large frame's room goes with it: a connection keeps at most 1 MiB between frames.
    if (c.filled == 0 && c.buffer.size() > (1 << 20)) std::string(kChunk, '\0').swap(c.buffer);
    // Less than there was room for: the socket is drained (a read more would find nothing, and
    // the poll, level-triggered, reports whatever comes next).
    if (static_cast<size_t>(n) < room) return true;
  }
  return true;
}

void StreamListener::ReadLoop() {
  // Connections are looked at for silence every second while a frame is part way, else every
  // half minute (idle bounds are minutes), so an idle listener wakes rarely.
  constexpr absl::Duration kPartWay = absl::Seconds(1), kIdleSweep = absl::Seconds(30);
  std::vector<epoll_event> events(256);
  absl::Time next_sweep = absl::Now() + kIdleSweep;
  while (true) {
    const int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), RemainingMs(next_sweep));
    if (n < 0 && errno != EINTR) {  // (not seen: the descriptors are this object's own)
      PW_LOG(Error) << "stream listener: epoll_wait: " << Errno(errno) << "; trying again in 100 ms";
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    const absl::Time now = absl::Now();
    for (int i = 0; i < n; ++i) {
      auto* c = static_cast<FrameReader*>(events[i].data.ptr);
      if (c == nullptr) return;  // stopping: the destructor closes what is left
      // (Only this thread removes readers, and each is in a batch of events once.)
      if (!ReadFrames(*c, now)) {
        absl::MutexLock lock(&mu_);
        CloseReader(c);
      } else if (c->filled > 0) {
        next_sweep = std::min(next_sweep, now + kPartWay);
      }
    }
    if (now < next_sweep) continue;
    // A frame stopped part way (its sender frozen or gone: it writes the frame again on a new
    // connection), or a connection idle past its protocol's bound. (Only this thread removes
    // readers, so those listed stay while it looks, without the lock.)
    std::vector<FrameReader*> all, late;
    {
      absl::MutexLock lock(&mu_);
      all.assign(readers_.begin(), readers_.end());
    }
    bool part_way_left = false;
    for (FrameReader* c : all) {
      // Bytes that came while this thread was busy count: read them before judging.
      if (c->filled > 0 && now - c->progress > c->protocol->frame_silence && !ReadFrames(*c, now)) {
        late.push_back(c);
        continue;
      }
      const bool part_way = c->filled > 0;
      if ((part_way && now - c->progress > c->protocol->frame_silence) ||
          (!part_way && now - c->last_frame > c->protocol->idle)) {
        late.push_back(c);
      } else {
        part_way_left = part_way_left || part_way;
      }
    }
    absl::MutexLock lock(&mu_);
    for (FrameReader* c : late) CloseReader(c);
    next_sweep = now + (part_way_left ? kPartWay : kIdleSweep);
  }
}

}  // namespace pathways
