// PeerMesh's exchange of messages (peer_mesh.h). Which call the mesh is in, and how a failed call
// is told to the peers and read from them, are in peer_mesh_calls.cc.
#include "collective/peer_mesh.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/peer_mesh_internal.h"
#include "core/socket_util.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

constexpr int kMaxIov = 64;

// A send or receive on a peer's connection failed with `err`. A reset is the peer's process gone
// (killed, or it gave up on the call and closed): said as plainly as a clean close.
absl::Status Broken(absl::string_view doing, const std::string& peer, int err) {
  if (err == ECONNRESET || err == EPIPE) {
    return absl::UnavailableError(absl::StrCat("host ", peer, " closed the connection (", Errno(err), ")"));
  }
  return absl::UnavailableError(absl::StrCat(doing, " host ", peer, ": ", Errno(err)));
}

// Messages of later calls kept per peer (see Exchange) (their size at most: kMaxStashedBytes).
constexpr size_t kMaxStashed = 64;
const absl::Duration kStashedFor = absl::Minutes(5);
// How long a waiting step spins (yielding) before it sleeps in poll (see Exchange). A chained
// program's nodes reach a collective a few tens of microseconds apart on different hosts (each
// node's set-up and trace around the body), longer than a fused loop's calls: with 50 µs a
// waiting host mostly slept and paid a wake-up per node. collective_bench side by side (scalar
// all_reduce, 3 pairs of runs): Chained 1.6-2.9x at 2 hosts and 1.1-1.4x at 4 with 250 µs
// against 50, OpByOp 1.0-1.2x, Fused within its noise; 1000 µs gained nothing more.
const absl::Duration kSpin = absl::Microseconds(250);

// How many reads from one peer a pass of Exchange makes before it looks at the others and at the
// deadline (what is not read yet stays in the socket and the call's state).
constexpr int kReadsPerPass = 256;

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
  enum Phase { kHeader, kPayload, kDiscard, kStash, kNotice, kDone };
  bool active = false;
  Phase phase = kHeader;
  MessageHeader header{};
  size_t header_got = 0;
  std::vector<Piece> pieces;
  size_t expected = 0;  // payload bytes of the message we want
  size_t got = 0;       // payload bytes read in the current phase
  size_t pieces_done = 0;
  std::string stash;  // kStash: a later call's payload; kNotice: a failure notice's
};

}  // namespace

PeerMesh::PeerMesh(std::vector<std::string> hosts, int rank, DcnEmulation* dcn)
    : hosts_(std::move(hosts)),
      rank_(rank),
      dcn_(dcn),
      fds_(hosts_.size(), -1),
      cut_(hosts_.size(), 0),
      seen_(hosts_.size(), false),
      next_ask_(hosts_.size()),
      ask_interval_(hosts_.size()),
      stash_(hosts_.size()) {}

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

absl::Status PeerMesh::Exchange(absl::Span<PeerTransfer> transfers, CallId id, uint32_t step, uint32_t signature,
                                absl::Time deadline) {
  Enter(id);
  const size_t n = transfers.size();
  std::vector<SendState> sends(n);
  std::vector<RecvState> recvs(n);
  // A message left part way either way (the call failed) leaves its connection unusable.
  absl::Cleanup note_cut = [&] {
    for (size_t i = 0; i < n; ++i) {
      const SendState& s = sends[i];
      const RecvState& r = recvs[i];
      if (s.active && s.done > 0 && s.done < s.total) cut_[transfers[i].peer] |= kCutOut;
      if (r.active && r.phase != RecvState::kDone && (r.phase != RecvState::kHeader || r.header_got > 0)) {
        cut_[transfers[i].peer] |= kCutIn;
      }
    }
  };
  // Set when a peer's message for this step has another size or signature (members disagree).
  absl::Status mismatch;
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
  // this host is done with (or of runs it never started) are dropped there, and others left for
  // their calls (a message of an execution this host never runs otherwise ages out).
  auto from_stash = [&](size_t i) -> absl::Status {
    RecvState& r = recvs[i];
    auto& stash = stash_[transfers[i].peer];
    const absl::Time now = absl::Now();
    for (auto it = stash.begin(); it != stash.end();) {
      const MessageHeader& h = it->header;
      if (h.execution == id.execution) seen_[transfers[i].peer] = true;
      if (h.magic == kNoticeMagic && h.execution == id.execution && h.call == id.call) {
        const std::string body = std::move(it->payload);
        stash.erase(it);
        return Relay(transfers[i].peer, h, body);
      }
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
      s.header = {kMessageMagic, signature, id.execution, id.call, step, TotalBytes(t.send), 0, id.run};
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
      r.expected = TotalBytes(t.recv);
      PW_RETURN_IF_ERROR(from_stash(i));
    }
  }
  int64_t deliver_us = 0;
  std::vector<pollfd> fds;
  auto timed_out = [&] {
    std::vector<std::string> waiting;
    for (size_t i = 0; i < n; ++i) {
      if ((sends[i].active && sends[i].done < sends[i].total) ||
          (recvs[i].active && recvs[i].phase != RecvState::kDone)) {
        waiting.push_back(hosts_[transfers[i].peer]);
      }
    }
    return absl::DeadlineExceededError(
        absl::StrCat("still waiting for host(s) ", absl::StrJoin(waiting, ", "), " at the deadline"));
  };
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
        if (got < 0) {
          // A peer that failed the call closed after saying why, which can be waiting to be read.
          absl::Status broken = Broken("sending to", peer, errno);
          RecvState& r = recvs[i];
          if (r.active && r.phase != RecvState::kHeader) return broken;
          MessageHeader h{};
          return r.active ? TakeNotice(transfers[i].peer, fd, r.header, r.header_got, broken, deadline)
                          : TakeNotice(transfers[i].peer, fd, h, 0, broken, deadline);
        }
        s.done += static_cast<size_t>(got);
        moved = true;
      }
      if (s.active && s.done < s.total) pending = true;

      RecvState& r = recvs[i];
      if (r.active && r.phase == RecvState::kHeader && r.header_got == 0 && !aborted.ok()) r.active = false;
      // A pass reads a bounded number of times from one peer: one that keeps its connection full
      // (of stale messages this call drops) would otherwise keep the pass from ever reaching the
      // deadline check (seen under load: a 300 ms call held 5 s).
      for (int reads = 0; r.active && r.phase != RecvState::kDone && reads < kReadsPerPass; ++reads) {
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
        if (got < 0) return Broken("receiving from", peer, errno);
        moved = true;
        if (r.phase == RecvState::kHeader) {
          r.header_got += static_cast<size_t>(got);
          if (r.header_got < sizeof(MessageHeader)) continue;
          // A whole header: whose message is it?
          const MessageHeader& h = r.header;
          r.got = 0;
          if (h.execution == id.execution) seen_[transfers[i].peer] = true;
          if (h.magic == kNoticeMagic) {
            // A peer's failure notice: read whole, then sorted by its call (below).
            if (h.bytes > kMaxNoticeBytes) {
              return absl::InvalidArgumentError(
                  absl::StrCat("host ", peer, " sent a failure notice of ", h.bytes, " bytes"));
            }
            r.stash.assign(h.bytes, '\0');
            r.phase = RecvState::kNotice;
          } else if (h.magic != kMessageMagic) {
            return absl::InvalidArgumentError(
                absl::StrCat("host ", peer, " sent bytes that are not a collective message"));
          } else if (h.execution == id.execution && h.call == id.call && h.step == step) {
            if (absl::Status wrong = ours(i, h); !wrong.ok()) {
              // Read past (its sender sends it whole) before failing: the connection stays whole,
              // so the peer is told on it, and does not find it closed in its next call.
              if (mismatch.ok()) mismatch = std::move(wrong);
              r.phase = RecvState::kDiscard;
            } else {
              deliver_us = std::max(deliver_us, h.deliver_us);
              r.phase = r.expected == 0 ? RecvState::kDone : RecvState::kPayload;
            }
          } else if (Stale(h, id, step)) {
            // A lagging peer's message for a call this host is done with (or never starts): dropped.
            r.phase = RecvState::kDiscard;
          } else {
            // A later call's: kept for it, and this call is abandoned.
            if (h.bytes > kMaxStashedBytes) {
              return absl::ResourceExhaustedError(
                  absl::StrCat("host ", peer, " sent a collective message of ", h.bytes, " bytes for a later call"));
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
          const MessageHeader& h = r.header;
          if (r.phase == RecvState::kNotice && h.execution == id.execution && h.call == id.call) {
            // The peer failed this call: so does this host, for the same reason (the stream is whole).
            r.phase = RecvState::kHeader;
            r.header_got = 0;
            return Relay(transfers[i].peer, h, r.stash);
          }
          const bool later_notice = r.phase == RecvState::kNotice && !Stale(h, id, step);
          if (r.phase == RecvState::kStash || later_notice) {
            auto& stash = stash_[transfers[i].peer];
            stash.push_back({r.header, std::move(r.stash), absl::Now()});
            if (stash.size() > kMaxStashed) stash.pop_front();
            abort(transfers[i].peer);
          }
          r.phase = RecvState::kHeader;
          r.header_got = 0;
          if (!mismatch.ok()) return mismatch;
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
    // Moving does not put off the deadline: a peer that keeps sending what this call drops (stale
    // messages or notices) cannot hold it there.
    if (moved && absl::Now() < deadline) {
      idle_since = absl::InfiniteFuture();
      continue;
    }
    if (moved) return timed_out();
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
    // In slices, so that a peer that left the island (frozen: its connection stays open) ends the
    // wait as soon as the controller says so, not at the deadline.
    const int ms = RemainingMs(deadline);
    const int ready = ms == 0 ? 0 : poll(fds.data(), fds.size(), std::min(ms, kCheckPeersMs));
    if (ready == 0) {
      for (size_t i = 0; i < n; ++i) {
        const bool waiting = (sends[i].active && sends[i].done < sends[i].total) ||
                             (recvs[i].active && recvs[i].phase != RecvState::kDone);
        if (!waiting) continue;
        if (absl::Status gone = StillComing(transfers[i].peer, deadline); !gone.ok()) return gone;
      }
    }
    if (ready == 0 && ms <= kCheckPeersMs) return timed_out();
    if (ready == 0) continue;
    if (ready < 0 && errno != EINTR) return absl::InternalError(absl::StrCat("poll: ", Errno(errno)));
  }
}

}  // namespace pathways::collective
