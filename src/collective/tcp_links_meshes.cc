// TcpLinks' meshes (tcp_links.h): connecting one for a call over the connections the listener
// took, running the call on it, and telling the peers when a call fails. The listener, the
// handshake and the streams are in tcp_links.cc.
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "collective/tcp_links.h"  // IWYU pragma: associated
#include "core/socket_util.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

// Failed calls remembered (over every set of devices; the oldest go first), to tell a peer that
// dials in for one late.
constexpr size_t kFailedCallsKept = 1024;
// How long a host whose call failed before reaching the mesh tries to reach a peer that waits for
// it to dial (TcpLinks::Abandon).
constexpr absl::Duration kAbandonDial = absl::Seconds(2);

// Which of a peer's connections dialed in a mesh takes: the one dialed for its call; else the
// newest the peer still holds, dialed for a call the mesh is not in (a peer out of step: the call
// itself sorts that out, see PeerMesh::Exchange). Closed ones dialed for other calls wait for
// theirs, holding why the peer failed them. -1: none.
int Pick(const std::vector<TcpLinks::DialIn>& waiting, CallId call, bool only_this_call) {
  int live = -1;
  for (int i = 0; i < static_cast<int>(waiting.size()); ++i) {
    if (waiting[i].id == call) return i;
    if (!only_this_call && !PeerClosed(waiting[i].fd)) live = i;
  }
  return live;
}

}  // namespace

int TcpLinks::TakeDialIn(PeerMesh& mesh, int p, const std::string& key, bool only_this_call) {
  absl::MutexLock lock(&mu_);
  auto it = dialed_in_.find(std::make_pair(key, mesh.host(p)));
  if (it == dialed_in_.end()) return -1;
  std::vector<DialIn>& waiting = it->second;
  // Those dialed for calls this host is done with go.
  for (auto d = waiting.begin(); d != waiting.end();) {
    if (mesh.past_.contains(d->id.execution)) {
      close(d->fd);
      d = waiting.erase(d);
      --waiting_dial_ins_;
    } else {
      ++d;
    }
  }
  const int i = Pick(waiting, mesh.current_, only_this_call);
  const int fd = i < 0 ? -1 : waiting[i].fd;
  if (i >= 0) {
    waiting.erase(waiting.begin() + i);
    --waiting_dial_ins_;
  }
  if (waiting.empty()) dialed_in_.erase(it);
  return fd;
}

absl::StatusOr<int> TcpLinks::AwaitDialIn(PeerMesh& mesh, int p, const std::string& key, absl::Time deadline) {
  const std::string& peer = mesh.host(p);
  int fd = -1;
  while (fd < 0) {
    {
      absl::MutexLock lock(&mu_);
      const auto slot = std::make_pair(key, peer);
      auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stop_ || stop_waiting_ || departed_.contains(peer)) return true;
        auto it = dialed_in_.find(slot);
        return it != dialed_in_.end() && Pick(it->second, mesh.current_, false) >= 0;
      };
      const bool came = mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline);
      if (stop_ || stop_waiting_) {
        return absl::CancelledError(
            absl::StrCat("host ", host_, " is shutting down; it waited for ", peer, " to connect for collectives"));
      }
      PW_RETURN_IF_ERROR(DepartedLocked(peer));
      if (!came) {
        return absl::DeadlineExceededError(absl::StrCat("host ", peer, " did not connect for collectives in time"));
      }
    }
    // (What arrived may have gone in between, as a connection of a call this host is done with.)
    fd = TakeDialIn(mesh, p, key);
  }
  if (!PeerClosed(fd)) return fd;
  // Dialed for this call and closed already: what the peer sent before it failed is still to be
  // read (its messages, then a notice), or a notice says why it failed.
  absl::StatusOr<bool> keep = mesh.KeepClosed(p, fd, deadline);
  if (keep.ok() && *keep) return fd;
  close(fd);
  if (!keep.ok()) return keep.status();
  return absl::UnavailableError(absl::StrCat("host ", peer, " closed the connection it made for this collective"));
}

absl::Status TcpLinks::Connect(PeerMesh& mesh, const std::string& key, absl::Time deadline) {
  PW_RETURN_IF_ERROR(EnsurePublished());
  const uint64_t dial_ins = dial_ins_.load(std::memory_order_acquire);
  const bool dialed_in = dial_ins != mesh.dial_ins_seen_;
  mesh.dial_ins_seen_ = dial_ins;
  // Lower-ranked peers first: we dial them; then we wait for the higher-ranked ones to dial us.
  for (int p = 0; p < mesh.size(); ++p) {
    if (p == mesh.rank()) continue;
    int& fd = mesh.fds_[p];
    if (p > mesh.rank() && dialed_in) {
      // A peer that reconnected since our last call dialed again for this one; its new
      // connection wins.
      const int newer = TakeDialIn(mesh, p, key);
      if (newer >= 0) {
        if (fd >= 0) close(fd);
        fd = newer;
      }
    }
    if (fd >= 0 && PeerClosed(fd)) {
      // A peer that failed this call before we came to it: what it sent is still to be read.
      PW_ASSIGN_OR_RETURN(const bool keep, mesh.KeepClosed(p, fd, deadline));
      if (!keep) {
        close(fd);
        fd = -1;
      }
    }
    if (fd >= 0 || p > mesh.rank()) continue;
    PW_ASSIGN_OR_RETURN(fd, Dial(mesh.host(p), key, mesh.current_, deadline));
  }
  for (int p = mesh.rank() + 1; p < mesh.size(); ++p) {
    if (mesh.fds_[p] >= 0) continue;
    PW_ASSIGN_OR_RETURN(mesh.fds_[p], AwaitDialIn(mesh, p, key, deadline));
  }
  return absl::OkStatus();
}

std::shared_ptr<PeerMesh> TcpLinks::MeshFor(const std::vector<std::string>& hosts, int rank, const std::string& key) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<PeerMesh>& slot = meshes_[key];
  if (slot == nullptr || slot->hosts_ != hosts || slot->rank_ != rank) {
    slot = std::make_shared<PeerMesh>(hosts, rank, dcn_);
    slot->departed_ = [this](const std::string& peer) {
      absl::MutexLock lock(&mu_);
      return DepartedLocked(peer);
    };
  }
  return slot;
}

absl::Status TcpLinks::Run(const std::vector<std::string>& hosts, int rank, const std::string& key, CallId id,
                           absl::Time deadline, absl::FunctionRef<absl::Status(PeerMesh&)> body) {
  std::shared_ptr<PeerMesh> mesh = MeshFor(hosts, rank, key);
  absl::MutexLock lock(&mesh->mu_);
  mesh->Enter(id);  // before connecting: a failure there is this call's, and says so to the peers
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& peer : hosts) {
      if (peer != host_ && s.ok()) s = DepartedLocked(peer);
    }
  }
  if (s.ok()) s = Connect(*mesh, key, deadline);
  if (s.ok()) s = body(*mesh);
  // An abandoned call (Aborted) left the streams whole and the peers with no cause to hear.
  if (!s.ok() && !absl::IsAborted(s)) Failed(*mesh, key, s);
  return s;
}

void TcpLinks::Failed(PeerMesh& mesh, const std::string& key, const absl::Status& status) {
  const CallId id = mesh.current_;
  const std::string notice = mesh.NoticeOf(status);
  {
    // Peers that dial in for this call from now on are told as they come (TakeConnection); those
    // that did before, on connections not yet taken, with the others.
    absl::MutexLock lock(&mu_);
    std::deque<FailedCall>& failed = failed_calls_[key];
    failed.push_back({id, notice});
    failed_order_.push_back(key);
    if (failed_order_.size() > kFailedCallsKept) {
      auto oldest = failed_calls_.find(failed_order_.front());
      oldest->second.pop_front();
      if (oldest->second.empty()) failed_calls_.erase(oldest);
      failed_order_.pop_front();
    }
  }
  for (int p = mesh.rank() + 1; p < mesh.size(); ++p) {
    const int newer = TakeDialIn(mesh, p, key, /*only_this_call=*/true);
    if (newer < 0) continue;
    if (mesh.fds_[p] >= 0) close(mesh.fds_[p]);
    mesh.fds_[p] = newer;
    mesh.cut_[p] = 0;
  }
  // A peer not heard from in a call that failed for any reason but members disagreeing may never
  // have come to it.
  mesh.Fail(notice, /*close_unseen=*/!absl::IsInvalidArgument(status));
}

void TcpLinks::Abandon(const std::vector<std::string>& hosts, int rank, const std::string& key, CallId id,
                       const absl::Status& status) {
  std::shared_ptr<PeerMesh> mesh = MeshFor(hosts, rank, key);
  absl::MutexLock lock(&mesh->mu_);
  mesh->Enter(id);
  // Peers this host dials would wait for it to connect: it does, to tell them.
  const absl::Time deadline = absl::Now() + kAbandonDial;
  for (int p = 0; p < rank; ++p) {
    int& fd = mesh->fds_[p];
    if (fd >= 0 && PeerClosed(fd)) {
      close(fd);
      fd = -1;
    }
    if (fd >= 0) continue;
    absl::StatusOr<int> dialed = Dial(mesh->host(p), key, id, deadline);
    if (dialed.ok()) fd = *dialed;
  }
  Failed(*mesh, key, status);
}

}  // namespace pathways::collective
