#include "collective/tcp_links.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "openssl/crypto.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "openssl/rand.h"

namespace pathways::collective {
namespace {

// How long one attempt to dial a peer may take (connect and handshake); attempts go on until the
// call's deadline.
constexpr absl::Duration kDialAttempt = absl::Seconds(2);

constexpr uint32_t kHelloMagic = 0x50574c32;  // "PWL2" (hellos name their call since "PWLH")
constexpr uint32_t kMaxKeyBytes = 1 << 20;
constexpr uint32_t kMaxHostBytes = 1024;
// Connections dialed in and not yet taken by a mesh (each is a descriptor held for a peer, for a
// call this host has yet to make): in all, and per peer and set of devices (the oldest go first).
constexpr size_t kMaxWaitingDialIns = 4096;
constexpr size_t kMaxWaitingDialInsPerPeer = 64;
// Connections whose hello is still arriving (the oldest goes first beyond this), and how long a
// hello may take. A dialer sends it at once after connecting; it is small.
constexpr size_t kMaxPendingHellos = 256;
constexpr size_t kMaxPendingHelloBytes = 16 << 20;  // what they may make the listener hold
constexpr absl::Duration kHelloTimeout = absl::Seconds(2);

struct HelloHeader {
  uint32_t magic;
  uint32_t key_bytes;
  uint32_t host_bytes;
  uint32_t call;  // the collective call a mesh's connection is dialed for (CallId); 0 for streams
  uint64_t execution;
  uint64_t run;
};
constexpr size_t kChallengeBytes = 16;
constexpr size_t kProofBytes = 32;

// Each side proves the cluster's secret to the other: HMAC-SHA256 under it of its role, both
// sides' challenges and the hello (key and host, each length-prefixed by the header). The
// dialer's proof ends its hello; the listener answers with its own once it checked the dialer's.
std::string Proof(const std::string& secret, char role, const std::string& challenges, const HelloHeader& header,
                  const std::string& key, const std::string& host) {
  std::string message(1, role);
  message += challenges;
  message.append(reinterpret_cast<const char*>(&header), sizeof(header));
  message += key;
  message += host;
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_bytes = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &mac_bytes);
  return std::string(reinterpret_cast<const char*>(mac), kProofBytes);
}

bool SameProof(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;  // constant time
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpLinks>> TcpLinks::Create(std::string host, const std::string& ip,
                                                           std::shared_ptr<KeyValueStore> store, DcnEmulation* dcn,
                                                           std::string secret, int port) {
  if (port < 0 || port > 65535) return absl::InvalidArgumentError(absl::StrCat("link port ", port, " is not in 0..65535"));
  socklen_t len = 0;
  auto addr = ParseAddress(absl::StrCat(ip, ":1"), &len);
  if (!addr.ok()) return addr.status();
  reinterpret_cast<sockaddr_in*>(&*addr)->sin_port = htons(static_cast<uint16_t>(port));  // same offset in sockaddr_in6
  const int fd = socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("collective socket: ", Errno(errno)));
  // A fixed port comes back after a restart despite connections of the last process in
  // TIME_WAIT; SO_REUSEADDR (not SO_REUSEPORT) still refuses a port another process listens on.
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&*addr), len) != 0 || listen(fd, 128) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen for links between hosts on ", ip, ":", port, ": ", Errno(err)));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int bound_port = ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string address =
      addr->ss_family == AF_INET6 ? absl::StrCat("[", ip, "]:", bound_port) : absl::StrCat(ip, ":", bound_port);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("eventfd: ", Errno(errno)));
  }
  return std::unique_ptr<TcpLinks>(
      new TcpLinks(std::move(host), fd, wake, address, std::move(store), dcn, std::move(secret)));
}

TcpLinks::TcpLinks(std::string host, int listen_fd, int wake_fd, std::string address,
                   std::shared_ptr<KeyValueStore> store, DcnEmulation* dcn, std::string secret)
    : host_(std::move(host)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      address_(std::move(address)),
      store_(std::move(store)),
      dcn_(dcn),
      secret_(std::move(secret)) {
  acceptor_ = std::thread([this] {
    NameThisThread("links-accept");
    AcceptLoop();
  });
}

TcpLinks::~TcpLinks() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  acceptor_.join();
  close(listen_fd_);
  close(wake_fd_);
  absl::MutexLock lock(&mu_);
  for (auto& [key, waiting] : dialed_in_) {
    for (const DialIn& d : waiting) close(d.fd);
  }
  meshes_.clear();
}

absl::Status TcpLinks::Publish() {
  PW_RETURN_IF_ERROR(store_->Set(absl::StrCat("collective-links/", host_), address_));
  published_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status TcpLinks::EnsurePublished() {
  if (published_.load(std::memory_order_acquire)) return absl::OkStatus();
  return Publish();
}

namespace {

// A connection dialed in whose hello is still arriving. The listener sent its challenge at once;
// the hello (header, key, host, the dialer's challenge, its proof) is read as it comes, beside
// every other connection's, so a peer that connects and says nothing holds up no one.
struct PendingHello {
  int fd;
  absl::Time deadline;
  std::string challenges;  // the listener's
  std::string received;    // the hello so far
};

// The whole hello's length once its header is in; 0 before (or for a header that is not one).
size_t HelloBytes(const std::string& received) {
  if (received.size() < sizeof(HelloHeader)) return 0;
  HelloHeader h;
  std::memcpy(&h, received.data(), sizeof(h));
  if (h.magic != kHelloMagic || h.key_bytes > kMaxKeyBytes || h.host_bytes > kMaxHostBytes) return 0;
  return sizeof(h) + h.key_bytes + h.host_bytes + kChallengeBytes + kProofBytes;
}

// Reads what has arrived. OK with `complete` once the whole hello is in; an error for a peer that
// closed, broke, or sent something that is not a hello.
absl::Status ReadHello(PendingHello& p, bool& complete) {
  char buffer[4096];
  while (true) {
    size_t want = sizeof(HelloHeader) - std::min(p.received.size(), sizeof(HelloHeader));
    if (want == 0) {
      const size_t total = HelloBytes(p.received);
      if (total == 0) return absl::InvalidArgumentError("a connection that is not a collective peer's");
      want = total - p.received.size();
    }
    if (want == 0) {
      complete = true;
      return absl::OkStatus();
    }
    const ssize_t n = recv(p.fd, buffer, std::min(want, sizeof(buffer)), 0);
    if (n > 0) {
      p.received.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return absl::OkStatus();
    if (n < 0 && errno == EINTR) continue;
    return absl::UnavailableError(n == 0 ? std::string("closed before its hello") : Errno(errno));
  }
}

}  // namespace

absl::Status TcpLinks::FinishHello(int fd, absl::Time deadline, std::string challenges, const std::string& received,
                                   std::string& key, std::string& peer, CallId& id) {
  HelloHeader hello;
  std::memcpy(&hello, received.data(), sizeof(hello));
  id = {hello.execution, hello.call, hello.run};
  size_t at = sizeof(hello);
  key = received.substr(at, hello.key_bytes);
  at += hello.key_bytes;
  peer = received.substr(at, hello.host_bytes);
  at += hello.host_bytes;
  challenges += received.substr(at, kChallengeBytes);
  at += kChallengeBytes;
  const std::string proof = received.substr(at, kProofBytes);
  if (!SameProof(proof, Proof(secret_, 'D', challenges, hello, key, peer))) {
    return absl::UnauthenticatedError(absl::StrCat("a connection claiming to be host ", peer.substr(0, 64),
                                                   " did not prove the cluster token"));
  }
  std::string mine = Proof(secret_, 'L', challenges, hello, key, peer);
  // 32 bytes on a connection that has sent nothing else: the socket buffer takes them at once.
  return TransferAll(fd, mine.data(), mine.size(), true, deadline, "proof");
}

void TcpLinks::TakeConnection(int fd, std::string key, std::string peer, CallId id) {
  Configure(fd);
  if (key == kAskWithdrawnKey) {
    AnswerWithdrawn(fd, id);
    return;
  }
  {
    absl::MutexLock handlers(&handlers_mu_);
    if (auto it = stream_handlers_.find(key); it != stream_handlers_.end()) {
      it->second(fd, peer);
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  // Dialed for a call that failed here already: the peer is told why (it would wait on this
  // connection otherwise), and it is closed.
  if (auto failed = failed_calls_.find(key); failed != failed_calls_.end()) {
    for (const FailedCall& f : failed->second) {
      if (!(f.id == id)) continue;
      (void)send(fd, f.notice.data(), f.notice.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      close(fd);
      return;
    }
  }
  std::vector<DialIn>& waiting = dialed_in_[{key, peer}];
  // A peer dials again for the same call only once it dropped the first connection.
  auto same = std::find_if(waiting.begin(), waiting.end(), [&](const DialIn& d) { return d.id == id; });
  if (same != waiting.end()) {
    close(same->fd);
    waiting.erase(same);
  }
  if (waiting.size() >= kMaxWaitingDialInsPerPeer) {
    PW_LOG(Warning) << "collective listener of " << host_ << ": " << kMaxWaitingDialInsPerPeer << " connections from "
                    << peer << " wait to be used; dropped the oldest";
    close(waiting.front().fd);
    waiting.erase(waiting.begin());
    --waiting_dial_ins_;
  }
  if (waiting_dial_ins_ >= kMaxWaitingDialIns) {
    PW_LOG(Warning) << "collective listener of " << host_ << ": " << kMaxWaitingDialIns
                    << " connections wait to be used; dropped one from " << peer;
    close(fd);
    if (waiting.empty()) dialed_in_.erase(std::make_pair(key, peer));
    return;
  }
  waiting.push_back({fd, id});
  ++waiting_dial_ins_;
  dial_ins_.fetch_add(1, std::memory_order_release);
}

void TcpLinks::AcceptLoop() {
  std::vector<PendingHello> pending;
  auto drop = [&](size_t i, const absl::Status& why) {
    PW_LOG(Warning) << "collective listener of " << host_ << " dropped a connection: " << why;
    close(pending[i].fd);
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  };
  while (true) {
    std::vector<pollfd> polled = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    absl::Time next = absl::InfiniteFuture();
    for (const PendingHello& p : pending) {
      polled.push_back({p.fd, POLLIN, 0});
      next = std::min(next, p.deadline);
    }
    const int timeout = next == absl::InfiniteFuture() ? -1 : RemainingMs(next);
    if (poll(polled.data(), polled.size(), timeout) < 0 && errno != EINTR) {
      PW_LOG(Error) << "collective listener of " << host_ << ": poll: " << Errno(errno);
      break;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
    }
    // Hellos that arrived, completed or ran out of time. Backwards: finished ones leave.
    const absl::Time now = absl::Now();
    for (size_t i = pending.size(); i-- > 0;) {
      bool complete = false;
      absl::Status s = (polled[2 + i].revents & (POLLIN | POLLHUP | POLLERR)) != 0 ? ReadHello(pending[i], complete)
                                                                                    : absl::OkStatus();
      std::string key, peer;
      CallId id;
      if (s.ok() && complete) {
        const PendingHello& p = pending[i];
        s = FinishHello(p.fd, p.deadline, p.challenges, p.received, key, peer, id);
      }
      if (!s.ok()) {
        drop(i, s);
      } else if (complete) {
        const int fd = pending[i].fd;
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        TakeConnection(fd, std::move(key), std::move(peer), id);
      } else if (now >= pending[i].deadline) {
        drop(i, absl::DeadlineExceededError("its hello did not come in time"));
      }
    }
    // Hellos may be long (a key names every device of a gang); strangers may not make the
    // listener hold more than kMaxPendingHelloBytes: the oldest go first.
    size_t held = 0;
    for (const PendingHello& p : pending) held += p.received.size();
    while (held > kMaxPendingHelloBytes) {
      held -= pending[0].received.size();
      drop(0, absl::ResourceExhaustedError("hellos in progress hold too many bytes"));
    }
    if ((polled[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors (serving processes report it as ECONNABORTED, see core/process.cc):
      // the pending connection may stay queued and poll() would return at once.
      // (The process logs those itself, and connections beyond the listener's cap.)
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM || errno == ECONNABORTED) {
        if (errno != ECONNABORTED) PW_LOG(Warning) << "collective listener of " << host_ << ": " << Errno(errno);
        absl::SleepFor(absl::Milliseconds(50));
      }
      continue;
    }
    // The listener challenges first; the dialer's hello proves the secret over both challenges.
    pending.push_back({fd, absl::Now() + kHelloTimeout, std::string(kChallengeBytes, '\0'), ""});
    PendingHello& hello = pending.back();
    absl::Status s = RAND_bytes(reinterpret_cast<unsigned char*>(hello.challenges.data()), kChallengeBytes) == 1
                         ? TransferAll(fd, hello.challenges.data(), kChallengeBytes, true, hello.deadline, "challenge")
                         : absl::InternalError("no random bytes for a challenge");
    if (!s.ok()) {
      drop(pending.size() - 1, s);
    } else if (pending.size() > kMaxPendingHellos) {
      drop(0, absl::ResourceExhaustedError("too many hellos in progress"));
    }
  }
  for (const PendingHello& p : pending) close(p.fd);
}

void TcpLinks::StopWaiting() {
  absl::MutexLock lock(&mu_);
  stop_waiting_ = true;
}

void TcpLinks::SetDeparted(absl::flat_hash_map<std::string, std::string> why) {
  absl::MutexLock lock(&mu_);  // waits re-check as it is released
  departed_ = std::move(why);
}

void TcpLinks::Returned(const std::vector<std::string>& hosts) {
  absl::MutexLock lock(&mu_);
  for (const std::string& host : hosts) departed_.erase(host);
}

absl::Status TcpLinks::DepartedLocked(const std::string& peer) {
  auto it = departed_.find(peer);
  if (it == departed_.end()) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("host ", peer, " left the island",
                                             it->second.empty() ? "" : absl::StrCat(" (", it->second, ")"),
                                             "; a collective over it cannot complete"));
}

absl::StatusOr<int> TcpLinks::Dial(const std::string& peer, const std::string& key, CallId id, absl::Time deadline) {
  absl::Status last = absl::DeadlineExceededError("no attempt");
  // A restarted peer republishes a new address: a refused connection looks it up again.
  for (int attempt = 0; absl::Now() < deadline; ++attempt) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_waiting_) return absl::CancelledError(absl::StrCat("host ", host_, " is shutting down"));
      PW_RETURN_IF_ERROR(DepartedLocked(peer));
    }
    if (attempt > 0) absl::SleepFor(std::min(absl::Milliseconds(5 * attempt), deadline - absl::Now()));
    std::string address;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = addresses_.find(peer); it != addresses_.end() && attempt == 0) address = it->second;
    }
    if (address.empty()) {
      // Looked up in attempts too: a peer that left before it ever published its address (its
      // first call saw the departure first) is found to have left between them, not at the deadline.
      auto looked_up =
          store_->Get(absl::StrCat("collective-links/", peer), std::min(deadline - absl::Now(), kDialAttempt));
      if (absl::IsDeadlineExceeded(looked_up.status()) && absl::Now() < deadline) {
        last = looked_up.status();
        continue;
      }
      if (!looked_up.ok()) return looked_up.status();
      address = *looked_up;
      absl::MutexLock lock(&mu_);
      addresses_[peer] = address;
    }
    // Each attempt is bounded on its own, so that a peer that stopped answering (frozen: its
    // kernel still accepts the connection) is found to have left the island between attempts.
    const absl::Time attempt_deadline = std::min(deadline, absl::Now() + kDialAttempt);
    socklen_t len = 0;
    auto addr = ParseAddress(address, &len);
    if (!addr.ok()) return addr.status();
    const int fd = socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return absl::UnavailableError(absl::StrCat("collective socket: ", Errno(errno)));
    absl::Status s;
    if (connect(fd, reinterpret_cast<sockaddr*>(&*addr), len) != 0 && errno != EINPROGRESS) {
      s = absl::UnavailableError(absl::StrCat("connecting to ", address, ": ", Errno(errno)));
    } else {
      pollfd p{fd, POLLOUT, 0};
      const int ms = RemainingMs(attempt_deadline);
      int err = 0;
      socklen_t err_len = sizeof(err);
      if (ms == 0 || poll(&p, 1, ms) != 1) {
        s = absl::DeadlineExceededError(absl::StrCat("connecting to ", address, ": timed out"));
      } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) != 0 || err != 0) {
        s = absl::UnavailableError(absl::StrCat("connecting to ", address, ": ", Errno(err)));
      }
    }
    if (s.ok()) {
      Configure(fd);
      std::string challenges(2 * kChallengeBytes, '\0');  // the listener's, then ours
      s = TransferAll(fd, challenges.data(), kChallengeBytes, false, attempt_deadline, "challenge");
      if (s.ok() && RAND_bytes(reinterpret_cast<unsigned char*>(challenges.data()) + kChallengeBytes,
                               kChallengeBytes) != 1) {
        s = absl::InternalError("no random bytes for a challenge");
      }
      std::string hello(sizeof(HelloHeader), '\0');
      const HelloHeader h{
          kHelloMagic, static_cast<uint32_t>(key.size()), static_cast<uint32_t>(host_.size()), id.call, id.execution,
          id.run};
      std::memcpy(hello.data(), &h, sizeof(h));
      hello += key;
      hello += host_;
      hello.append(challenges, kChallengeBytes, kChallengeBytes);
      hello += Proof(secret_, 'D', challenges, h, key, host_);
      if (s.ok()) s = TransferAll(fd, hello.data(), hello.size(), true, attempt_deadline, "hello");
      std::string theirs(kProofBytes, '\0');
      if (s.ok()) s = TransferAll(fd, theirs.data(), theirs.size(), false, attempt_deadline, "proof");
      if (s.ok() && !SameProof(theirs, Proof(secret_, 'L', challenges, h, key, host_))) {
        s = absl::UnauthenticatedError(absl::StrCat("the listener at ", address, " did not prove the cluster token"));
      }
      if (s.ok()) return fd;
    }
    close(fd);
    last = s;
  }
  return absl::Status(last.code(), absl::StrCat("host ", peer, " cannot be reached over the links between hosts: ", last.message()));
}

void TcpLinks::AcceptStreams(const std::string& key, std::function<void(int fd, const std::string& peer)> handler) {
  absl::MutexLock lock(&handlers_mu_);
  if (handler == nullptr) {
    stream_handlers_.erase(key);
  } else {
    stream_handlers_[key] = std::move(handler);
  }
}

absl::StatusOr<int> TcpLinks::DialStream(const std::string& peer, const std::string& key, absl::Time deadline) {
  PW_RETURN_IF_ERROR(EnsurePublished());
  return Dial(peer, key, CallId{}, deadline);
}

}  // namespace pathways::collective
