// PeerMesh (peer_mesh.h): which call the mesh is in and which executions it is done with, whether
// a waited-for peer still comes, and failures told to the peers (notices) and read from them. The
// exchange of messages itself is in peer_mesh.cc.
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "absl/strings/str_cat.h"
#include "collective/peer_mesh.h"  // IWYU pragma: associated
#include "collective/peer_mesh_internal.h"
#include "core/socket_util.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

// How long a host waits for the rest of a notice it has begun to read: its sender wrote it whole
// just before closing.
const absl::Duration kNoticeWait = absl::Seconds(1);
// Executions remembered as done, to recognise a lagging peer's messages.
constexpr size_t kPastExecutions = 4096;
// Asking a peer whether it withdrew from a call dials it (a handshake on both sides): a peer that
// is slow to come (a long kernel before the call) is asked at intervals doubling up to
// kMaxAskInterval, one peer of the mesh a slice at most, and each ask waits kAskWait at most for
// the answer (a frozen peer never gives one; the controller says when it left).
constexpr absl::Duration kMaxAskInterval = absl::Seconds(4);
constexpr absl::Duration kAskWait = absl::Milliseconds(250);

// A failure notice's body: the host where the failure began, the host that withdrew from the call
// (empty when none did: PeerMesh::StillComing) and the cause, each but the last ended by a NUL.
struct NoticeBody {
  std::string origin, withdrew, cause;
};
NoticeBody ParseNotice(const std::string& body) {
  NoticeBody notice;
  const size_t first = body.find('\0');
  const size_t second = first == std::string::npos ? std::string::npos : body.find('\0', first + 1);
  if (second == std::string::npos) {
    notice.cause = body;
    return notice;
  }
  notice.origin = body.substr(0, first);
  notice.withdrew = body.substr(first + 1, second - first - 1);
  notice.cause = body.substr(second + 1);
  return notice;
}

}  // namespace

void PeerMesh::Fail(const std::string& notice, bool close_unseen) {
  for (int p = 0; p < size(); ++p) {
    int& fd = fds_[p];
    if (fd < 0) continue;
    // Best effort: never waits for room. A notice that did not go whole leaves the stream cut.
    bool whole = (cut_[p] & kCutOut) == 0;
    if (whole) {
      ssize_t sent;
      do {
        sent = send(fd, notice.data(), notice.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      } while (sent < 0 && errno == EINTR);
      whole = sent == static_cast<ssize_t>(notice.size());
    }
    // Kept only where both ways are whole, the peer is still there, it had shown itself in this
    // call (one that never came may not know the call is over, and would take what this host
    // sent for it for a later call's) unless told otherwise, and it is not part way through
    // sending this host a message of the call (it would wait on a full connection to its deadline
    // where a close tells it at once).
    bool keep = whole && cut_[p] == 0 && !PeerClosed(fd) && (seen_[p] || !close_unseen);
    if (keep) {
      int unread = 0;
      MessageHeader h{};
      if (ioctl(fd, FIONREAD, &unread) != 0) {
        keep = false;
      } else if (unread > 0) {
        const bool header = recv(fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT) == static_cast<ssize_t>(sizeof(h));
        keep = header && (h.execution != current_.execution || static_cast<uint64_t>(unread) >= sizeof(h) + h.bytes);
      }
    }
    if (!keep) {
      close(fd);
      fd = -1;
      stash_[p].clear();
    }
  }
  cut_.assign(cut_.size(), 0);
  relayed_origin_.clear();
  relayed_cause_.clear();
  withdrew_.clear();
}

std::string PeerMesh::NoticeOf(const absl::Status& status) const {
  std::string body = relayed_origin_.empty() ? hosts_[rank_] : relayed_origin_;
  body.push_back('\0');
  body += withdrew_;
  body.push_back('\0');
  const absl::string_view cause = relayed_origin_.empty() ? status.message() : absl::string_view(relayed_cause_);
  body.append(cause.data(), cause.size());
  body.resize(std::min(body.size(), kMaxNoticeBytes));
  const MessageHeader header{
      kNoticeMagic, static_cast<uint32_t>(status.code()), current_.execution, current_.call, 0, body.size(), 0,
      current_.run};
  return std::string(reinterpret_cast<const char*>(&header), sizeof(header)) + body;
}

absl::Status PeerMesh::Relay(int r, const MessageHeader& h, const std::string& body) {
  NoticeBody notice = ParseNotice(body);
  relayed_origin_ = notice.origin.empty() ? hosts_[r] : std::move(notice.origin);
  relayed_cause_ = std::move(notice.cause);
  if (!notice.withdrew.empty()) withdrew_ = std::move(notice.withdrew);
  // The same code as where it began, except those that would keep this host in the call.
  absl::StatusCode code = static_cast<absl::StatusCode>(h.signature);
  if (h.signature > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated) || code == absl::StatusCode::kOk ||
      code == absl::StatusCode::kAborted || code == absl::StatusCode::kCancelled) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(
      code, absl::StrCat("host ", relayed_origin_, " failed this collective",
                         relayed_origin_ == hosts_[r] ? "" : absl::StrCat(" (host ", hosts_[r], " says)"), ": ",
                         relayed_cause_));
}

absl::Status PeerMesh::TakeNotice(int r, int fd, MessageHeader& h, size_t got, absl::Status otherwise,
                                  absl::Time deadline) {
  const absl::Time until = std::min(deadline, absl::Now() + kNoticeWait);
  auto read_all = [&](char* p, size_t n) {
    while (n > 0) {
      const ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
      } else if (k < 0 && errno == EINTR) {
        continue;
      } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd readable{fd, POLLIN, 0};
        const int ms = RemainingMs(until);
        if (ms == 0 || (poll(&readable, 1, ms) < 0 && errno != EINTR)) return false;
      } else {
        return false;  // closed, or broken, before the notice was whole
      }
    }
    return true;
  };
  if (!read_all(reinterpret_cast<char*>(&h) + got, sizeof(h) - got) || h.magic != kNoticeMagic ||
      h.bytes > kMaxNoticeBytes) {
    return otherwise;
  }
  std::string body(h.bytes, '\0');
  if (!read_all(body.data(), body.size())) return otherwise;
  if (h.execution != current_.execution || h.call != current_.call) {
    return absl::UnavailableError(absl::StrCat("host ", hosts_[r],
                                               " closed the connection after it failed another collective (",
                                               ParseNotice(body).cause, ")"));
  }
  return Relay(r, h, body);
}

absl::StatusOr<bool> PeerMesh::KeepClosed(int r, int fd, absl::Time deadline) {
  // Everything the peer sent is here: whole messages of calls this host is done with go first.
  while (true) {
    MessageHeader h{};
    if (recv(fd, &h, sizeof(h), MSG_PEEK | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof(h))) return false;
    if (h.magic == kMessageMagic && Stale(h, current_, 0) && h.bytes <= kMaxStashedBytes) {
      std::string skip(sizeof(h) + h.bytes, '\0');
      if (recv(fd, skip.data(), skip.size(), MSG_WAITALL | MSG_DONTWAIT) != static_cast<ssize_t>(skip.size())) {
        return false;
      }
      continue;
    }
    if (h.execution != current_.execution) return false;
    if (h.magic == kMessageMagic) return h.call >= current_.call;
    absl::Status failed = TakeNotice(r, fd, h, 0, absl::OkStatus(), deadline);
    if (failed.ok()) return false;
    return failed;
  }
}

bool PeerMesh::Stale(const MessageHeader& h, CallId id, uint32_t step) const {
  if (past_.contains(h.execution)) return true;
  if (h.execution == id.execution) return h.call < id.call || (h.call == id.call && h.step < step);
  return h.run != 0 && not_started_ != nullptr && not_started_(h.run);
}

void PeerMesh::Past(uint64_t execution, bool entered) {
  if (execution == current_.execution || !past_.emplace(execution, entered).second) return;
  past_order_.push_back(execution);
  if (past_order_.size() > kPastExecutions) {
    past_.erase(past_order_.front());
    past_order_.pop_front();
  }
}

absl::Status PeerMesh::StillComing(int r, absl::Time deadline) {
  if (wanted_ != nullptr && *wanted_ != nullptr) PW_RETURN_IF_ERROR((*wanted_)());
  if (departed_ != nullptr) PW_RETURN_IF_ERROR(departed_(hosts_[r]));
  if (ask_withdrawn_ == nullptr) return absl::OkStatus();
  if (!(asks_for_ == current_)) {  // the first wait of this call
    asks_for_ = current_;
    next_ask_.assign(next_ask_.size(), absl::InfinitePast());
    ask_interval_.assign(ask_interval_.size(), absl::ZeroDuration());
  }
  const absl::Time now = absl::Now();
  // One ask a slice at most: each holds the call (and the departure checks of the other peers).
  if (now < next_ask_[r] || now < next_ask_any_) return absl::OkStatus();
  ask_interval_[r] = std::min(kMaxAskInterval, std::max(absl::Milliseconds(kCheckPeersMs), 2 * ask_interval_[r]));
  next_ask_[r] = now + ask_interval_[r];
  next_ask_any_ = now + absl::Milliseconds(kCheckPeersMs);
  absl::Status withdrawn = ask_withdrawn_(hosts_[r], current_, std::min(deadline, now + kAskWait));
  if (!withdrawn.ok()) withdrew_ = hosts_[r];
  return withdrawn;
}

void PeerMesh::Enter(CallId id) {
  if (id.execution == current_.execution) {
    current_ = id;
    return;
  }
  seen_.assign(seen_.size(), false);
  const uint64_t before = current_.execution;
  current_ = id;
  if (before != 0) Past(before, /*entered=*/true);
  // Entered again (two groups over the same devices take turns on the mesh): not past any more.
  past_.erase(id.execution);
}

}  // namespace pathways::collective
