// TcpLinks' meshes (tcp_links.h): connecting one for a call over the connections the listener
// took, running the call on it, and telling the peers when a call fails. The listener, the
// handshake and the streams are in tcp_links.cc.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "collective/collective_internal.h"
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
// Withdrawals remembered (TcpLinks::Withdrew), the oldest going first, and executions held for
// meshes to count as past. Each keeps at most kMaxAnswerBytes of why.
constexpr size_t kMaxWithdrawals = 4096;
// The answer to AskWithdrawn: a code (0: the asker may wait on), then a message of `message_bytes`.
constexpr uint32_t kAnswerMagic = 0x50575741;  // "PWWA"
constexpr uint32_t kMaxAnswerBytes = 1024;
struct WithdrawnAnswer {
  uint32_t magic;
  int32_t code;
  uint32_t message_bytes;
  uint32_t unused;
};

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
  // Those dialed for calls this host is done with go: for calls it entered, and for calls it
  // withdrew from that the peer has closed since (the peer may go on using one it still holds).
  for (auto d = waiting.begin(); d != waiting.end();) {
    auto past = mesh.past_.find(d->id.execution);
    if (past != mesh.past_.end() && (past->second || PeerClosed(d->fd))) {
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
    bool came = false;
    {
      absl::MutexLock lock(&mu_);
      const auto slot = std::make_pair(key, peer);
      auto arrived = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stop_ || stop_waiting_ || departed_.contains(peer)) return true;
        auto it = dialed_in_.find(slot);
        return it != dialed_in_.end() && Pick(it->second, mesh.current_, false) >= 0;
      };
      // In slices, to ask the peer now and then whether it withdrew from the call.
      came = mu_.AwaitWithDeadline(absl::Condition(&arrived),
                                   std::min(deadline, absl::Now() + absl::Milliseconds(PeerMesh::kCheckPeersMs)));
      if (stop_ || stop_waiting_) {
        return absl::CancelledError(
            absl::StrCat("host ", host_, " is shutting down; it waited for ", peer, " to connect for collectives"));
      }
      PW_RETURN_IF_ERROR(DepartedLocked(peer));
      if (!came && absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("host ", peer, " did not connect for collectives in time"));
      }
    }
    if (!came) {
      PW_RETURN_IF_ERROR(mesh.StillComing(p, deadline));
      continue;
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
  // A peer that reconnected since our last call dialed again for this one; its new connection wins.
  for (int p = mesh.rank() + 1; dialed_in && p < mesh.size(); ++p) {
    const int newer = TakeDialIn(mesh, p, key);
    if (newer < 0) continue;
    if (mesh.fds_[p] >= 0) close(mesh.fds_[p]);
    mesh.fds_[p] = newer;
  }
  // Every connection is checked in one poll, and again after anything that can wait (reading a
  // closed peer's notice, dialing): peers that close meanwhile are seen as the old check of each
  // peer just before its turn saw them.
  std::vector<bool> closed = PeersClosed(mesh.fds_);
  // Lower-ranked peers first: we dial them; then we wait for the higher-ranked ones to dial us.
  for (int p = 0; p < mesh.size(); ++p) {
    if (p == mesh.rank()) continue;
    int& fd = mesh.fds_[p];
    if (fd >= 0 && closed[p]) {
      // A peer that failed this call before we came to it: what it sent is still to be read.
      PW_ASSIGN_OR_RETURN(const bool keep, mesh.KeepClosed(p, fd, deadline));
      if (!keep) {
        close(fd);
        fd = -1;
      }
      closed = PeersClosed(mesh.fds_);
    }
    if (fd >= 0 || p > mesh.rank()) continue;
    PW_ASSIGN_OR_RETURN(fd, Dial(mesh.host(p), key, mesh.current_, deadline));
    closed = PeersClosed(mesh.fds_);
  }
  for (int p = mesh.rank() + 1; p < mesh.size(); ++p) {
    if (mesh.fds_[p] >= 0) continue;
    PW_ASSIGN_OR_RETURN(mesh.fds_[p], AwaitDialIn(mesh, p, key, deadline));
  }
  return absl::OkStatus();
}

void TcpLinks::Withdrew(std::vector<Withdrawal> withdrawals) {
  absl::MutexLock lock(&mu_);
  for (Withdrawal& w : withdrawals) {
    const std::string message(w.why.message().substr(0, kMaxAnswerBytes));
    if (withdrawals_.insert_or_assign(w.execution, Withdrawn{w.from_call, absl::Status(w.why.code(), message)})
            .second) {
      withdrawal_order_.push_back(w.execution);
    }
    withdrawn_meshes_[w.mesh].push_back(w.execution);
    withdrawn_mesh_order_.emplace_back(w.mesh, w.execution);
  }
  while (withdrawal_order_.size() > kMaxWithdrawals) {
    withdrawals_.erase(withdrawal_order_.front());
    withdrawal_order_.pop_front();
  }
  // The oldest a mesh has not taken yet (it was not used since) go: a peer's message for one then
  // reads there as a later call's, and fails the call it comes in (PeerMesh::Exchange).
  while (withdrawn_mesh_order_.size() > kMaxWithdrawals) {
    const auto [mesh, execution] = withdrawn_mesh_order_.front();
    if (auto it = withdrawn_meshes_.find(mesh); it != withdrawn_meshes_.end()) {
      std::vector<uint64_t>& executions = it->second;
      executions.erase(std::remove(executions.begin(), executions.end(), execution), executions.end());
      if (executions.empty()) withdrawn_meshes_.erase(it);
    }
    withdrawn_mesh_order_.pop_front();
  }
}

void TcpLinks::RunNotStarted(uint64_t run, uint64_t client, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  const absl::Status kept(why.ok() ? absl::StatusCode::kInternal : why.code(),
                          why.message().substr(0, kMaxAnswerBytes));
  auto [it, fresh] = not_started_.try_emplace(run, NotStarted{kept, client});
  if (!fresh) {
    it->second.why = kept;
    return;
  }
  not_started_of_[client].push_back({run, ++not_started_seq_});
  if (not_started_.size() > kMaxWithdrawals) {
    // The client holding the most records loses its oldest (of two that hold as many, the one
    // whose oldest is older): clients that fail runs here on purpose, however many, push out only
    // their own while any of them holds more than an honest client.
    auto most = not_started_of_.begin();
    for (auto c = not_started_of_.begin(); c != not_started_of_.end(); ++c) {
      if (c->second.size() > most->second.size() ||
          (c->second.size() == most->second.size() && c->second.front().seq < most->second.front().seq)) {
        most = c;
      }
    }
    not_started_.erase(most->second.front().run);
    most->second.pop_front();
    if (most->second.empty()) not_started_of_.erase(most);
  }
  not_started_count_.store(not_started_.size(), std::memory_order_relaxed);
}

void TcpLinks::AnswerWithdrawn(int fd, CallId id) {
  std::string message;
  WithdrawnAnswer answer{kAnswerMagic, 0, 0, 0};
  {
    absl::MutexLock lock(&mu_);
    const absl::Status* why = nullptr;
    if (auto it = withdrawals_.find(id.execution); it != withdrawals_.end() && id.call >= it->second.from_call) {
      why = &it->second.why;
    } else if (auto run = not_started_.find(id.run); id.run != 0 && run != not_started_.end()) {
      why = &run->second.why;
    }
    if (why != nullptr) {
      answer.code = static_cast<int32_t>(why->code());
      message = std::string(why->message().substr(0, kMaxAnswerBytes));
      answer.message_bytes = static_cast<uint32_t>(message.size());
    }
  }
  std::string out(sizeof(answer), '\0');
  std::memcpy(out.data(), &answer, sizeof(answer));
  out += message;
  // A few bytes on a connection that has sent nothing else: the socket buffer takes them at once.
  (void)send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  close(fd);
}

absl::Status TcpLinks::AskWithdrawn(const std::string& peer, CallId id, absl::Time deadline) {
  absl::StatusOr<int> fd = Dial(peer, kAskWithdrawnKey, id, deadline);
  if (!fd.ok()) return absl::OkStatus();  // not answering: whether it left is the controller's to say
  WithdrawnAnswer answer{};
  std::string message;
  absl::Status read = TransferAll(*fd, reinterpret_cast<char*>(&answer), sizeof(answer), false, deadline, "answer");
  if (read.ok() && answer.magic == kAnswerMagic && answer.code != 0 && answer.message_bytes <= kMaxAnswerBytes) {
    message.resize(answer.message_bytes);
    read = TransferAll(*fd, message.data(), message.size(), false, deadline, "answer");
  }
  close(*fd);
  if (!read.ok() || answer.magic != kAnswerMagic || answer.code == 0 || answer.message_bytes > kMaxAnswerBytes) {
    return absl::OkStatus();
  }
  // A code that would read as this host's own timeout, or as members disagreeing (which keeps
  // the connections of peers not seen in the call), or as a call abandoned whole, says unavailable.
  absl::StatusCode code = static_cast<absl::StatusCode>(answer.code);
  if (answer.code < 0 || answer.code > static_cast<int>(absl::StatusCode::kUnauthenticated) ||
      code == absl::StatusCode::kAborted || code == absl::StatusCode::kDeadlineExceeded ||
      code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kCancelled) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, message);
}

std::shared_ptr<PeerMesh> TcpLinks::MeshFor(const std::vector<std::string>& hosts, int rank, const std::string& key) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<PeerMesh>& slot = meshes_[key];
  if (slot == nullptr || slot->hosts_ != hosts || slot->rank_ != rank) {
    slot = std::make_shared<PeerMesh>(hosts, rank, dcn_);
    slot->key_hash_ = Fnv64(key);
    slot->departed_ = [this](const std::string& peer) {
      absl::MutexLock lock(&mu_);
      if (stop_waiting_) return absl::CancelledError(absl::StrCat("host ", host_, " is shutting down"));
      return DepartedLocked(peer);
    };
    slot->ask_withdrawn_ = [this](const std::string& peer, CallId id, absl::Time deadline) {
      return AskWithdrawn(peer, id, deadline);
    };
    slot->not_started_ = [this](uint64_t run) {
      if (not_started_count_.load(std::memory_order_relaxed) == 0) return false;
      absl::MutexLock lock(&mu_);
      return not_started_.contains(run);
    };
  }
  return slot;
}

absl::Status TcpLinks::Run(const std::vector<std::string>& hosts, int rank, const std::string& key, CallId id,
                           absl::Time deadline, absl::FunctionRef<absl::Status(PeerMesh&)> body,
                           const std::function<absl::Status()>& wanted) {
  std::shared_ptr<PeerMesh> mesh = MeshFor(hosts, rank, key);
  absl::MutexLock lock(&mesh->mu_);
  mesh->Enter(id);  // before connecting: a failure there is this call's, and says so to the peers
  mesh->wanted_ = &wanted;  // for this call only: unset below
  absl::Status s;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& peer : hosts) {
      if (peer != host_ && s.ok()) s = DepartedLocked(peer);
    }
    // Executions this host withdrew from on these devices are done with: what peers sent for
    // them is dropped.
    if (!withdrawn_meshes_.empty()) {
      if (auto it = withdrawn_meshes_.find(mesh->key_hash_); it != withdrawn_meshes_.end()) {
        for (uint64_t execution : it->second) mesh->Past(execution, /*entered=*/false);
        withdrawn_meshes_.erase(it);  // (its entries in withdrawn_mesh_order_ find nothing)
      }
    }
  }
  if (s.ok()) s = Connect(*mesh, key, deadline);
  if (s.ok()) s = body(*mesh);
  mesh->wanted_ = nullptr;
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
  // A peer not heard from in a call that failed for any reason but members disagreeing, or a peer
  // withdrawing, may never have come to it. (A withdrawn peer counts the call as past, and every
  // other peer comes to it, or came and is past it.)
  mesh.Fail(notice, /*close_unseen=*/!absl::IsInvalidArgument(status) && mesh.withdrew_.empty());
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
