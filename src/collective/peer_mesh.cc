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
// Messages of later calls kept per peer (see Exchange), and their size at most.
constexpr size_t kMaxStashed = 64;
constexpr uint64_t kMaxStashedBytes = uint64_t{1} << 30;
const absl::Duration kStashedFor = absl::Minutes(5);
// Executions remembered as done, to recognise a lagging peer's messages.
constexpr size_t kPastExecutions = 4096;
// How long a waiting step spins before it sleeps (see Exchange).
const absl::Duration kSpin = absl::Microseconds(50);

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

// Builds an iovec over `pieces` from byte `skip` on (at most kMaxIov entries).
int IovFrom(const std::vector<Piece>& pieces, size_t skip, iovec* iov) {
  int n = 0;
  for (const Piece& p : pieces) {
    if (n == kMaxIov) break;
    if (skip >= p.bytes) {
      skip -= p.bytes;
      continue;
    }
    iov[n++] = {p.data + skip, p.bytes - skip};
    skip = 0;
  }
  return n;
}

size_t Bytes(const std::vector<Piece>& pieces) {
  size_t n = 0;
  for (const Piece& p : pieces) n += p.bytes;
  return n;
}

// A message being sent: its header, then its pieces.
struct SendState {
  bool active = false;
  MessageHeader header{};
  std::vector<Piece> pieces;  // header first
  size_t total = 0;
  size_t done = 0;
};

// A message being received from one peer (see Exchange for the phases).
struct RecvState {
  enum Phase { kHeader, kPayload, kDiscard, kStash, kDone };
  bool active = false;
  Phase phase = kHeader;
  MessageHeader header{};
  size_t header_got = 0;
  std::vector<Piece> pieces;
  size_t expected = 0;  // payload bytes of the message we want
  size_t got = 0;       // payload bytes read in the current phase
  size_t pieces_done = 0;
  std::string stash;  // kStash: a later call's payload
};

}  // namespace

PeerMesh::PeerMesh(std::vector<std::string> hosts, int rank, DcnEmulation* dcn)
    : hosts_(std::move(hosts)), rank_(rank), dcn_(dcn), fds_(hosts_.size(), -1), stash_(hosts_.size()) {}

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
  for (auto& stash : stash_) stash.clear();  // read from connections that are gone
}

bool PeerMesh::Stale(const MessageHeader& h, CallId id, uint32_t step) const {
  if (past_.contains(h.execution)) return true;
  return h.execution == id.execution && (h.call < id.call || (h.call == id.call && h.step < step));
}

void PeerMesh::Enter(CallId id) {
  if (id.execution == current_.execution) {
    current_ = id;
    return;
  }
  if (current_.execution != 0 && past_.insert(current_.execution).second) {
    past_order_.push_back(current_.execution);
    if (past_order_.size() > kPastExecutions) {
      past_.erase(past_order_.front());
      past_order_.pop_front();
    }
  }
  current_ = id;
}

absl::Status PeerMesh::Exchange(absl::Span<PeerTransfer> transfers, CallId id, uint32_t step, uint32_t signature,
                                absl::Time deadline) {
  Enter(id);
  const size_t n = transfers.size();
  std::vector<SendState> sends(n);
  std::vector<RecvState> recvs(n);
  // Set when a peer turns out to be past this call: the step is abandoned, but every message
  // already started is finished, so the streams stay whole and the mesh open.
  absl::Status aborted;
  auto abort = [&](int peer) {
    if (!aborted.ok()) return;
    aborted = absl::AbortedError(absl::StrCat(
        "host ", hosts_[peer],
        " is past this collective (it sent a message of a later one): gangs that share devices were ordered "
        "differently, or this run failed there before the call"));
  };
  // A message that is ours: checked, then its payload lands in the pieces.
  auto ours = [&](size_t i, const MessageHeader& h) -> absl::Status {
    if (h.signature != signature || h.bytes != recvs[i].expected) {
      return absl::InvalidArgumentError(absl::StrCat("host ", hosts_[transfers[i].peer], " sends ", h.bytes,
                                                     " bytes where ", recvs[i].expected,
                                                     " were expected: members disagree on the collective, its dtype "
                                                     "or its shape"));
    }
    return absl::OkStatus();
  };
  auto hand_over = [&](size_t i) -> absl::Status {  // pieces complete so far go to on_piece
    RecvState& r = recvs[i];
    size_t end = 0;
    for (size_t p = 0; p < r.pieces.size(); ++p) {
      end += r.pieces[p].bytes;
      if (p < r.pieces_done) continue;
      if (end > r.got) break;
      r.pieces_done = p + 1;
      if (transfers[i].on_piece) PW_RETURN_IF_ERROR(transfers[i].on_piece(p));
    }
    return absl::OkStatus();
  };
  // A message read earlier for this very step is taken from the stash; messages of executions
  // this host is done with are dropped there, and others left for their calls (a message of an
  // execution this host never runs ages out).
  auto from_stash = [&](size_t i) -> absl::Status {
    RecvState& r = recvs[i];
    auto& stash = stash_[transfers[i].peer];
    const absl::Time now = absl::Now();
    for (auto it = stash.begin(); it != stash.end();) {
      const MessageHeader& h = it->header;
      if (Stale(h, id, step) || now - it->at > kStashedFor) {
        it = stash.erase(it);
        continue;
      }
      if (h.execution != id.execution || h.call != id.call || h.step != step) {
        ++it;
        continue;
      }
      PW_RETURN_IF_ERROR(ours(i, h));
      size_t offset = 0;
      for (const Piece& p : r.pieces) {
        std::memcpy(p.data, it->payload.data() + offset, p.bytes);
        offset += p.bytes;
      }
      stash.erase(it);
      r.got = r.expected;
      PW_RETURN_IF_ERROR(hand_over(i));
      r.phase = RecvState::kDone;
      return absl::OkStatus();
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < n; ++i) {
    PeerTransfer& t = transfers[i];
    if (t.peer < 0 || t.peer >= size() || t.peer == rank_ || fds_[t.peer] < 0) {
      return absl::InternalError(absl::StrCat("collective step names peer ", t.peer, " of a mesh of ", size()));
    }
    if (!t.send.empty()) {
      SendState& s = sends[i];
      s.active = true;
      s.header = {kMessageMagic, signature, id.execution, id.call, step, Bytes(t.send), 0};
      s.pieces.push_back({reinterpret_cast<char*>(&s.header), sizeof(MessageHeader)});
      s.pieces.insert(s.pieces.end(), t.send.begin(), t.send.end());
      s.total = sizeof(MessageHeader) + s.header.bytes;
      if (dcn_ != nullptr && dcn_->Crosses(hosts_[t.peer])) {
        s.header.deliver_us = absl::ToUnixMicros(dcn_->Arrival(hosts_[t.peer], s.total, absl::Now()));
      }
    }
    if (!t.recv.empty()) {
      RecvState& r = recvs[i];
      r.active = true;
      r.pieces = t.recv;
      r.expected = Bytes(t.recv);
      PW_RETURN_IF_ERROR(from_stash(i));
    }
  }
  int64_t deliver_us = 0;
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
      SendState& s = sends[i];
      if (s.active && s.done == 0 && !aborted.ok()) s.active = false;  // never started: not sent
      while (s.active && s.done < s.total) {
        iovec iov[kMaxIov];
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = IovFrom(s.pieces, s.done, iov);
        const ssize_t got = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (got < 0) return absl::UnavailableError(absl::StrCat("sending to host ", peer, ": ", Errno(errno)));
        s.done += static_cast<size_t>(got);
        moved = true;
      }
      if (s.active && s.done < s.total) pending = true;

      RecvState& r = recvs[i];
      if (r.active && r.phase == RecvState::kHeader && r.header_got == 0 && !aborted.ok()) r.active = false;
      while (r.active && r.phase != RecvState::kDone) {
        ssize_t got;
        char discard[64 << 10];
        if (r.phase == RecvState::kHeader) {
          got = recv(fd, reinterpret_cast<char*>(&r.header) + r.header_got, sizeof(MessageHeader) - r.header_got,
                     MSG_DONTWAIT);
        } else if (r.phase == RecvState::kPayload) {
          iovec iov[kMaxIov];
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = IovFrom(r.pieces, r.got, iov);
          got = recvmsg(fd, &msg, MSG_DONTWAIT);
        } else if (r.phase == RecvState::kDiscard) {
          got = recv(fd, discard, std::min<size_t>(sizeof(discard), r.header.bytes - r.got), MSG_DONTWAIT);
        } else {
          got = recv(fd, r.stash.data() + r.got, r.stash.size() - r.got, MSG_DONTWAIT);
        }
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (got == 0) return absl::UnavailableError(absl::StrCat("host ", peer, " closed the connection"));
        if (got < 0) return absl::UnavailableError(absl::StrCat("receiving from host ", peer, ": ", Errno(errno)));
        moved = true;
        if (r.phase == RecvState::kHeader) {
          r.header_got += static_cast<size_t>(got);
          if (r.header_got < sizeof(MessageHeader)) continue;
          // A whole header: whose message is it?
          const MessageHeader& h = r.header;
          r.got = 0;
          if (h.magic != kMessageMagic) {
            return absl::InvalidArgumentError(absl::StrCat("host ", peer, " sent bytes that are not a collective message"));
          }
          if (h.execution == id.execution && h.call == id.call && h.step == step) {
            PW_RETURN_IF_ERROR(ours(i, h));
            deliver_us = std::max(deliver_us, h.deliver_us);
            r.phase = r.expected == 0 ? RecvState::kDone : RecvState::kPayload;
          } else if (Stale(h, id, step)) {
            // A lagging peer's message for a call this host is done with: dropped.
            r.phase = RecvState::kDiscard;
          } else {
            // A later call's: kept for it, and this call is abandoned.
            if (h.bytes > kMaxStashedBytes) {
              return absl::ResourceExhaustedError(absl::StrCat("host ", peer, " sent a collective message of ", h.bytes,
                                                               " bytes for a later call"));
            }
            r.stash.assign(h.bytes, '\0');
            r.phase = RecvState::kStash;
          }
        } else {
          r.got += static_cast<size_t>(got);
          if (r.phase == RecvState::kPayload) PW_RETURN_IF_ERROR(hand_over(i));
        }
        // A message that is complete.
        const size_t total = r.phase == RecvState::kPayload ? r.expected : r.header.bytes;
        if (r.phase == RecvState::kDone || r.got < total) continue;
        if (r.phase == RecvState::kPayload) {
          r.phase = RecvState::kDone;
        } else {
          if (r.phase == RecvState::kStash) {
            auto& stash = stash_[transfers[i].peer];
            stash.push_back({r.header, std::move(r.stash), absl::Now()});
            if (stash.size() > kMaxStashed) stash.pop_front();
            abort(transfers[i].peer);
          }
          r.phase = RecvState::kHeader;
          r.header_got = 0;
          if (!aborted.ok()) r.active = false;  // nothing more is read for an abandoned call
        }
      }
      if (r.active && r.phase != RecvState::kDone) pending = true;
    }
    if (!pending) {
      if (!aborted.ok()) return aborted;
      // On an emulated DCN a message counts as received once the link would have delivered it.
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
      if (recvs[i].active && recvs[i].phase != RecvState::kDone) events |= POLLIN;
      if (events != 0) fds.push_back({fds_[transfers[i].peer], events, 0});
    }
    const int ms = RemainingMs(deadline);
    const int ready = ms == 0 ? 0 : poll(fds.data(), fds.size(), ms);
    if (ready == 0) {
      std::vector<std::string> waiting;
      for (size_t i = 0; i < n; ++i) {
        if ((sends[i].active && sends[i].done < sends[i].total) ||
            (recvs[i].active && recvs[i].phase != RecvState::kDone)) {
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
  // Closing tells the peers to reconnect before their next call on these devices. An abandoned
  // call (Aborted) left the streams whole: the mesh stays, with what it kept for later calls.
  if (!s.ok() && !absl::IsAborted(s)) mesh->CloseAll();
  return s;
}

}  // namespace pathways::collective
