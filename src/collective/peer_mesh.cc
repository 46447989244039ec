#include "collective/peer_mesh.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

constexpr uint32_t kMessageMagic = 0x50574331;  // "PWC1"
constexpr uint32_t kHelloMagic = 0x50574c48;    // "PWLH"
constexpr uint32_t kMaxKeyBytes = 1 << 20;
constexpr uint32_t kMaxHostBytes = 1024;
constexpr int kMaxIov = 64;
// Connections dialed in and not yet taken by a mesh: each is a descriptor held for a peer.
constexpr size_t kMaxWaitingDialIns = 4096;
// How long a waiting step spins before it sleeps (see Exchange).
const absl::Duration kSpin = absl::Microseconds(50);

// Precedes every message. Hosts of one cluster share a byte order.
struct MessageHeader {
  uint32_t magic;
  uint32_t signature;
  uint64_t tag;
  uint64_t bytes;
  // Emulated DCN only: when the message may be taken as delivered (Unix microseconds; hosts
  // that emulate share one machine's clock). 0: at once.
  int64_t deliver_us;
};

struct HelloHeader {
  uint32_t magic;
  uint32_t key_bytes;
  uint32_t host_bytes;
};

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

// Writes or reads all of [data, data+len) on a non-blocking socket before `deadline`.
absl::Status TransferAll(int fd, char* data, size_t len, bool write, absl::Time deadline, const std::string& what) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = write ? send(fd, data + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT)
                      : recv(fd, data + done, len - done, MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
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

// A connection the peer closed (or broke) since we last used it.
bool Stale(int fd) {
  char c;
  const ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

absl::StatusOr<sockaddr_storage> ParseAddress(const std::string& address, socklen_t* len) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad collective address '", address, "'"));
  }
  std::string ip = address.substr(0, colon);
  if (ip.size() > 2 && ip.front() == '[' && ip.back() == ']') ip = ip.substr(1, ip.size() - 2);
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
    return absl::InvalidArgumentError(absl::StrCat("bad collective address '", address, "'"));
  }
  return storage;
}

// The progress of one message, sent or received: its header, then its pieces.
struct MessageState {
  MessageHeader header{};
  std::vector<Piece> pieces;
  size_t total = 0;  // header included
  size_t done = 0;
  size_t pieces_done = 0;  // receive: pieces already handed to on_piece
  bool active = false;

  void Start(std::vector<Piece> p, uint64_t tag, uint32_t signature) {
    pieces = std::move(p);
    uint64_t bytes = 0;
    for (const Piece& piece : pieces) bytes += piece.bytes;
    header = {kMessageMagic, signature, tag, bytes, 0};
    total = sizeof(MessageHeader) + bytes;
    active = true;
  }
  // The iovec from `done` on.
  int Iov(iovec* iov) {
    int n = 0;
    size_t skip = done;
    auto add = [&](char* data, size_t len) {
      if (n == kMaxIov) return;
      if (skip >= len) {
        skip -= len;
        return;
      }
      iov[n++] = {data + skip, len - skip};
      skip = 0;
    };
    add(reinterpret_cast<char*>(&header), sizeof(header));
    for (const Piece& p : pieces) add(p.data, p.bytes);
    return n;
  }
};

}  // namespace

PeerMesh::PeerMesh(std::vector<std::string> hosts, int rank, DcnEmulation* dcn)
    : hosts_(std::move(hosts)), rank_(rank), dcn_(dcn), fds_(hosts_.size(), -1) {}

PeerMesh::~PeerMesh() { CloseAll(); }

char* PeerMesh::Scratch(size_t bytes) {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

void PeerMesh::CloseAll() {
  for (int& fd : fds_) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

absl::Status PeerMesh::Exchange(absl::Span<PeerTransfer> transfers, uint64_t tag, uint32_t signature,
                                absl::Time deadline) {
  const size_t n = transfers.size();
  std::vector<MessageState> sends(n), recvs(n);
  std::vector<MessageHeader> expected(n);
  for (size_t i = 0; i < n; ++i) {
    PeerTransfer& t = transfers[i];
    if (t.peer < 0 || t.peer >= size() || t.peer == rank_ || fds_[t.peer] < 0) {
      return absl::InternalError(absl::StrCat("collective step names peer ", t.peer, " of a mesh of ", size()));
    }
    if (!t.send.empty()) {
      sends[i].Start(t.send, tag, signature);
      if (dcn_ != nullptr && dcn_->Crosses(hosts_[t.peer])) {
        sends[i].header.deliver_us =
            absl::ToUnixMicros(dcn_->Arrival(hosts_[t.peer], sends[i].total, absl::Now()));
      }
    }
    if (!t.recv.empty()) {
      recvs[i].Start(t.recv, 0, 0);
      expected[i] = {kMessageMagic, signature, tag, recvs[i].header.bytes, 0};
    }
  }
  std::vector<pollfd> fds;
  // Nothing to do yet: spin a little (yielding the core) before sleeping in poll(). A peer's
  // answer usually comes within microseconds; being woken from poll() costs more than that.
  absl::Time idle_since = absl::InfiniteFuture();
  while (true) {
    bool pending = false;
    bool moved = false;
    for (size_t i = 0; i < n; ++i) {
      const int fd = fds_[transfers[i].peer];
      const std::string& peer = hosts_[transfers[i].peer];
      for (MessageState* m : {&sends[i], &recvs[i]}) {
        const bool is_send = m == &sends[i];
        while (m->active && m->done < m->total) {
          iovec iov[kMaxIov];
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = m->Iov(iov);
          const ssize_t got = is_send ? sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : recvmsg(fd, &msg, MSG_DONTWAIT);
          if (got < 0 && errno == EINTR) continue;
          if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (got == 0 && !is_send) return absl::UnavailableError(absl::StrCat("host ", peer, " closed the connection"));
          if (got < 0) {
            return absl::UnavailableError(absl::StrCat(is_send ? "sending to" : "receiving from", " host ", peer, ": ",
                                                       Errno(errno)));
          }
          const size_t before = m->done;
          m->done += static_cast<size_t>(got);
          moved = true;
          if (is_send) continue;
          // A receive is checked as soon as its header is in, before trusting what follows.
          if (before < sizeof(MessageHeader) && m->done >= sizeof(MessageHeader)) {
            const MessageHeader& h = m->header;
            const MessageHeader& want = expected[i];
            if (h.magic != kMessageMagic) {
              return absl::InvalidArgumentError(absl::StrCat("host ", peer, " sent bytes that are not a collective message"));
            }
            if (h.tag != want.tag) {
              return absl::AbortedError(absl::StrCat("host ", peer, " is in another collective (message ", h.tag,
                                                     ", expected ", want.tag,
                                                     "); gangs that share devices were ordered differently"));
            }
            if (h.signature != want.signature || h.bytes != want.bytes) {
              return absl::InvalidArgumentError(absl::StrCat("host ", peer, " sends ", h.bytes, " bytes where ", want.bytes,
                                                             " were expected: members disagree on the collective, its "
                                                             "dtype or its shape"));
            }
          }
          // Hand over the pieces that are complete.
          size_t end = sizeof(MessageHeader);
          for (size_t p = 0; p < m->pieces.size(); ++p) {
            end += m->pieces[p].bytes;
            if (p < m->pieces_done) continue;
            if (end > m->done) break;
            m->pieces_done = p + 1;
            if (transfers[i].on_piece) {
              absl::Status s = transfers[i].on_piece(p);
              if (!s.ok()) return s;
            }
          }
        }
        if (m->active && m->done < m->total) pending = true;
      }
    }
    if (!pending) {
      // On an emulated DCN a message counts as received once the link would have delivered it.
      int64_t deliver_us = 0;
      for (const MessageState& m : recvs) {
        if (m.active) deliver_us = std::max(deliver_us, m.header.deliver_us);
      }
      // Only a host that emulates takes the time its peer says, and never past the deadline.
      if (deliver_us > 0 && dcn_ != nullptr) {
        absl::SleepFor(std::min(absl::FromUnixMicros(deliver_us), deadline) - absl::Now());
      }
      return absl::OkStatus();
    }
    if (moved) {
      idle_since = absl::InfiniteFuture();
      continue;
    }
    const absl::Time now = absl::Now();
    if (idle_since == absl::InfiniteFuture()) idle_since = now;
    if (now - idle_since < kSpin) {
      sched_yield();
      continue;
    }
    fds.clear();
    for (size_t i = 0; i < n; ++i) {
      short events = 0;
      if (sends[i].active && sends[i].done < sends[i].total) events |= POLLOUT;
      if (recvs[i].active && recvs[i].done < recvs[i].total) events |= POLLIN;
      if (events != 0) fds.push_back({fds_[transfers[i].peer], events, 0});
    }
    const int ms = RemainingMs(deadline);
    const int ready = ms == 0 ? 0 : poll(fds.data(), fds.size(), ms);
    if (ready == 0) {
      std::vector<std::string> waiting;
      for (size_t i = 0; i < n; ++i) {
        if ((sends[i].active && sends[i].done < sends[i].total) || (recvs[i].active && recvs[i].done < recvs[i].total)) {
          waiting.push_back(hosts_[transfers[i].peer]);
        }
      }
      return absl::DeadlineExceededError(
          absl::StrCat("still waiting for host(s) ", absl::StrJoin(waiting, ", "), " at the deadline"));
    }
    if (ready < 0 && errno != EINTR) return absl::InternalError(absl::StrCat("poll: ", Errno(errno)));
  }
}

absl::StatusOr<std::unique_ptr<TcpLinks>> TcpLinks::Create(std::string host, const std::string& ip,
                                                           std::shared_ptr<KeyValueStore> store, DcnEmulation* dcn) {
  socklen_t len = 0;
  auto addr = ParseAddress(absl::StrCat(ip, ":1"), &len);
  if (!addr.ok()) return addr.status();
  reinterpret_cast<sockaddr_in*>(&*addr)->sin_port = 0;  // same offset in sockaddr_in6
  const int fd = socket(addr->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("collective socket: ", Errno(errno)));
  if (bind(fd, reinterpret_cast<sockaddr*>(&*addr), len) != 0 || listen(fd, 128) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen for collectives on ", ip, ": ", Errno(err)));
  }
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const int port = ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const std::string address = addr->ss_family == AF_INET6 ? absl::StrCat("[", ip, "]:", port) : absl::StrCat(ip, ":", port);
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("eventfd: ", Errno(errno)));
  }
  return std::unique_ptr<TcpLinks>(new TcpLinks(std::move(host), fd, wake, address, std::move(store), dcn));
}

TcpLinks::TcpLinks(std::string host, int listen_fd, int wake_fd, std::string address,
                   std::shared_ptr<KeyValueStore> store, DcnEmulation* dcn)
    : host_(std::move(host)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      address_(std::move(address)),
      store_(std::move(store)),
      dcn_(dcn) {
  acceptor_ = std::thread([this] { AcceptLoop(); });
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
  for (auto& [key, fd] : dialed_in_) close(fd);
  meshes_.clear();
}

absl::Status TcpLinks::Publish() {
  if (published_.load(std::memory_order_acquire)) return absl::OkStatus();
  PW_RETURN_IF_ERROR(store_->Set(absl::StrCat("collective-links/", host_), address_));
  published_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

void TcpLinks::AcceptLoop() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) {
      PW_LOG(Error) << "collective listener of " << host_ << ": poll: " << Errno(errno);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // Out of descriptors: the pending connection stays queued and poll() would return at once.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        PW_LOG(Warning) << "collective listener of " << host_ << ": " << Errno(errno);
        absl::SleepFor(absl::Milliseconds(50));
      }
      continue;
    }
    // The hello names the mesh and the dialing host. It is small and sent at once after
    // connecting; a peer that does not send it in time is dropped.
    const absl::Time deadline = absl::Now() + absl::Seconds(2);
    HelloHeader hello{};
    std::string key, peer;
    absl::Status s = TransferAll(fd, reinterpret_cast<char*>(&hello), sizeof(hello), false, deadline, "hello");
    if (s.ok() && (hello.magic != kHelloMagic || hello.key_bytes > kMaxKeyBytes || hello.host_bytes > kMaxHostBytes)) {
      s = absl::InvalidArgumentError("a connection that is not a collective peer's");
    }
    if (s.ok()) {
      key.resize(hello.key_bytes);
      peer.resize(hello.host_bytes);
      s = TransferAll(fd, key.data(), key.size(), false, deadline, "hello");
      if (s.ok()) s = TransferAll(fd, peer.data(), peer.size(), false, deadline, "hello");
    }
    if (!s.ok()) {
      PW_LOG(Warning) << "collective listener of " << host_ << " dropped a connection: " << s;
      close(fd);
      continue;
    }
    Configure(fd);
    absl::MutexLock lock(&mu_);
    if (dialed_in_.size() >= kMaxWaitingDialIns) {
      PW_LOG(Warning) << "collective listener of " << host_ << ": " << kMaxWaitingDialIns
                      << " connections wait to be used; dropped one from " << peer;
      close(fd);
      continue;
    }
    auto [it, inserted] = dialed_in_.try_emplace({std::move(key), std::move(peer)}, fd);
    if (!inserted) {
      close(it->second);
      it->second = fd;
    }
    dial_ins_.fetch_add(1, std::memory_order_release);
  }
}

int TcpLinks::TakeDialIn(const std::string& peer, const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = dialed_in_.find(std::make_pair(key, peer));
  if (it == dialed_in_.end()) return -1;
  const int fd = it->second;
  dialed_in_.erase(it);
  return fd;
}

absl::StatusOr<int> TcpLinks::AwaitDialIn(const std::string& peer, const std::string& key, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const auto slot = std::make_pair(key, peer);
  auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || dialed_in_.contains(slot); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline) || stop_) {
    return absl::DeadlineExceededError(absl::StrCat("host ", peer, " did not connect for collectives in time"));
  }
  auto it = dialed_in_.find(slot);
  const int fd = it->second;
  dialed_in_.erase(it);
  return fd;
}

absl::StatusOr<int> TcpLinks::Dial(const std::string& peer, const std::string& key, absl::Time deadline) {
  absl::Status last = absl::DeadlineExceededError("no attempt");
  // A restarted peer republishes a new address: a refused connection looks it up again.
  for (int attempt = 0; absl::Now() < deadline; ++attempt) {
    if (attempt > 0) absl::SleepFor(std::min(absl::Milliseconds(5 * attempt), deadline - absl::Now()));
    std::string address;
    {
      absl::MutexLock lock(&mu_);
      if (auto it = addresses_.find(peer); it != addresses_.end() && attempt == 0) address = it->second;
    }
    if (address.empty()) {
      auto looked_up = store_->Get(absl::StrCat("collective-links/", peer), deadline - absl::Now());
      if (!looked_up.ok()) return looked_up.status();
      address = *looked_up;
      absl::MutexLock lock(&mu_);
      addresses_[peer] = address;
    }
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
      const int ms = RemainingMs(deadline);
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
      std::string hello(sizeof(HelloHeader), '\0');
      const HelloHeader h{kHelloMagic, static_cast<uint32_t>(key.size()), static_cast<uint32_t>(host_.size())};
      std::memcpy(hello.data(), &h, sizeof(h));
      hello += key;
      hello += host_;
      s = TransferAll(fd, hello.data(), hello.size(), true, deadline, "hello");
      if (s.ok()) return fd;
    }
    close(fd);
    last = s;
  }
  return absl::Status(last.code(), absl::StrCat("host ", peer, " cannot be reached for collectives: ", last.message()));
}

absl::Status TcpLinks::Connect(PeerMesh& mesh, const std::string& key, absl::Time deadline) {
  PW_RETURN_IF_ERROR(Publish());
  const uint64_t dial_ins = dial_ins_.load(std::memory_order_acquire);
  const bool dialed_in = dial_ins != mesh.dial_ins_seen_;
  mesh.dial_ins_seen_ = dial_ins;
  // Lower-ranked peers first: we dial them; then we wait for the higher-ranked ones to dial us.
  for (int p = 0; p < mesh.size(); ++p) {
    if (p == mesh.rank()) continue;
    int& fd = mesh.fds_[p];
    if (p > mesh.rank() && dialed_in) {
      // A peer that reconnected since our last call dialed again; its new connection wins.
      const int newer = TakeDialIn(mesh.host(p), key);
      if (newer >= 0) {
        if (fd >= 0) close(fd);
        fd = newer;
      }
    }
    if (fd >= 0 && Stale(fd)) {
      close(fd);
      fd = -1;
    }
    if (fd >= 0 || p > mesh.rank()) continue;
    PW_ASSIGN_OR_RETURN(fd, Dial(mesh.host(p), key, deadline));
  }
  for (int p = mesh.rank() + 1; p < mesh.size(); ++p) {
    if (mesh.fds_[p] >= 0) continue;
    PW_ASSIGN_OR_RETURN(mesh.fds_[p], AwaitDialIn(mesh.host(p), key, deadline));
  }
  return absl::OkStatus();
}

absl::Status TcpLinks::Run(const std::vector<std::string>& hosts, int rank, const std::string& key,
                           absl::Time deadline, absl::FunctionRef<absl::Status(PeerMesh&)> body) {
  std::shared_ptr<PeerMesh> mesh;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<PeerMesh>& slot = meshes_[key];
    if (slot == nullptr || slot->hosts_ != hosts || slot->rank_ != rank) {
      slot = std::make_shared<PeerMesh>(hosts, rank, dcn_);
    }
    mesh = slot;
  }
  absl::MutexLock lock(&mesh->mu_);
  absl::Status s = Connect(*mesh, key, deadline);
  if (s.ok()) s = body(*mesh);
  // Closing tells the peers to reconnect before their next call on these devices.
  if (!s.ok()) mesh->CloseAll();
  return s;
}

}  // namespace pathways::collective
