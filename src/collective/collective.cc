#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/cross_host.h"
#include "collective/peer_mesh.h"
#include "collective/tcp_links.h"
#include "core/log_limiter.h"
#include "core/logging.h"
#include "core/status_macros.h"

namespace pathways::collective {

absl::Status InMemoryKeyValueStore::Set(const std::string& key, std::string value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKeyValueStore::Get(const std::string& key, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return values_.contains(key); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous key '", key, "' not set within ", absl::FormatDuration(timeout)));
  }
  return values_.at(key);
}

const char* CollectiveName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kRoll:
      return "roll";
  }
  return "collective";
}

namespace {

// FNV-1a: tags and signatures must be the same in every process (absl::Hash is seeded per
// process).
uint64_t Fnv64(absl::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Below this many bytes a host's members wait while the leader copies and reduces alone: waking
// threads to take parts costs more than the work. Measured with 4 members on one host
// (collective_bench --hub-only, 2 cores, 2026-12-05): shared out, a 4 MiB all_reduce ran 1.69x
// as many calls per second, a 256 KiB one the same, a 64 KiB one 0.65x.
constexpr size_t kShareBytes = size_t{512} << 10;

// Part p of n of [0, total), cut at multiples of 64 (elements or bytes: whole cache lines).
std::pair<size_t, size_t> PartOf(size_t total, int n, int p) {
  auto cut = [&](int q) { return q >= n ? total : (total * q / n) & ~size_t{63}; };
  return {cut(p), cut(p + 1)};
}

// What the leader does when its members are not there to share work with: every part itself.
absl::Status Alone(int n, absl::FunctionRef<absl::Status(int)> part) {
  for (int p = 0; p < n; ++p) PW_RETURN_IF_ERROR(part(p));
  return absl::OkStatus();
}

std::string Describe(const CollectiveCall& c) {
  // Collectives that only move data are handed any tensor as bytes (kBool elements): say bytes.
  const bool moves_bytes =
      c.dtype == DType::kBool && c.kind != CollectiveKind::kAllReduce && c.kind != CollectiveKind::kReduceScatter;
  std::string s = moves_bytes ? absl::StrCat(CollectiveName(c.kind), "(", c.count, " bytes")
                              : absl::StrCat(CollectiveName(c.kind), "(", DTypeName(c.dtype), "[", c.count, "]");
  if (c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter) {
    absl::StrAppend(&s, ", ", ReduceOpName(c.op));
  }
  if (c.kind == CollectiveKind::kBroadcast) absl::StrAppend(&s, ", root ", c.root);
  if (c.kind == CollectiveKind::kRoll) absl::StrAppend(&s, ", shift ", c.shift);
  return s + ")";
}

// Why a group mate fails when shard `shard` on `host` withdrew for `why` (CollectiveHub::Withdraw):
// with why's code, unless that would read as the mate's own timeout, or as members disagreeing
// (told to other hosts, that keeps the connections of peers never seen in the call open, and a
// peer whose members all withdrew too would find the notice in its next call).
absl::Status WillNotCome(const std::string& host, int64_t shard, const absl::Status& why) {
  const absl::StatusCode code =
      why.code() == absl::StatusCode::kDeadlineExceeded || why.code() == absl::StatusCode::kInvalidArgument
          ? absl::StatusCode::kAborted
          : why.code();
  return absl::Status(code, absl::StrCat("shard ", shard, " of this gang on host ", host,
                                         " will not come: it failed before the call (", why.message(), ")"));
}

// A host's own view of a failed collective, in its log. The client sees one shard's error, and
// in a call of several rounds that may name a host that was itself waiting; each host's line
// says what it saw. At most one line a second per process, with how many were left out.
void LogFailure(const std::string& host, const absl::Status& status) {
  ABSL_CONST_INIT static absl::Mutex mu(absl::kConstInit);
  static LogLimiter& limiter = *new LogLimiter(absl::Seconds(1));
  absl::MutexLock lock(&mu);
  if (!limiter.Say()) return;
  PW_LOG(Warning) << "host " << host << ": " << status << limiter.Unsaid("failed collectives not logged before it");
}

bool SameCall(const CollectiveCall& a, const CollectiveCall& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
         (a.kind != CollectiveKind::kBroadcast || a.root == b.root) &&
         (a.kind != CollectiveKind::kRoll || a.shift == b.shift) &&
         ((a.kind != CollectiveKind::kAllReduce && a.kind != CollectiveKind::kReduceScatter) || a.op == b.op);
}

// Appends [data, data+bytes) to `pieces`, merged with the last piece when adjacent.
void AddPiece(std::vector<Piece>& pieces, const char* data, size_t bytes) {
  char* p = const_cast<char*>(data);
  if (!pieces.empty() && pieces.back().data + pieces.back().bytes == p) {
    pieces.back().bytes += bytes;
  } else {
    pieces.push_back({p, bytes});
  }
}

}  // namespace

struct CollectiveHub::Meeting {
  Meeting(size_t size, std::string execution, std::vector<std::pair<int, int64_t>> local)
      : calls(size, nullptr), execution(std::move(execution)), local(std::move(local)) {}
  std::vector<const CollectiveCall*> calls;  // by group rank; this host's members only
  const std::string execution;
  const std::vector<std::pair<int, int64_t>> local;  // this host's members: group rank, shard
  // Failed because a member withdrew (Withdraw). The first member out tells the other hosts
  // (`told`); with the withdrawn members never coming, it goes once the others have left.
  bool withdrawn = false;
  bool told = false;
  int arrived = 0;
  int left = 0;
  bool done = false;
  absl::Status status;
  // Work the leader shares out (ShareOut): parts taken and finished so far, of `parts`.
  const absl::FunctionRef<void(int)>* work = nullptr;
  int parts = 0, next_part = 0, parts_done = 0;
};

CollectiveHub::CollectiveHub(std::string host, std::shared_ptr<TcpLinks> links, absl::Duration timeout)
    : host_(std::move(host)), links_(std::move(links)), timeout_(timeout) {}

CollectiveHub::~CollectiveHub() = default;

absl::Status CollectiveHub::Run(const GroupPlacement& placement, const std::string& execution,
                                const std::string& call_key, const CallId& id, const CollectiveCall& call) {
  const absl::Time start = absl::Now();
  in_progress_.fetch_add(1, std::memory_order_relaxed);
  absl::Status status = Meet(placement, execution, call_key, id, call);
  in_progress_.fetch_sub(1, std::memory_order_relaxed);
  const double us = absl::ToDoubleMicroseconds(absl::Now() - start);
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(std::begin(kLatencyBoundsUs), std::end(kLatencyBoundsUs), us) - std::begin(kLatencyBoundsUs));
  latency_buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  latency_sum_us_.fetch_add(static_cast<int64_t>(us), std::memory_order_relaxed);
  (status.ok() ? ok_ : failed_).fetch_add(1, std::memory_order_relaxed);
  return status;
}

CollectiveHub::Stats CollectiveHub::stats() const {
  Stats s;
  s.failed = failed_.load(std::memory_order_relaxed);
  s.calls = ok_.load(std::memory_order_relaxed) + s.failed;
  for (size_t i = 0; i < s.latency_buckets.size(); ++i) s.latency_buckets[i] = latency_buckets_[i].load(std::memory_order_relaxed);
  s.latency_sum_us = latency_sum_us_.load(std::memory_order_relaxed);
  s.in_progress = in_progress_.load(std::memory_order_relaxed);
  return s;
}

void CollectiveHub::Withdraw(const std::string& execution, int64_t shard, const absl::Status& why) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  ForgetWithdrawalsLocked(now);
  auto [it, first] = withdrawn_.try_emplace(execution);
  if (first) withdrawn_order_.emplace_back(now, execution);
  it->second.try_emplace(shard, why.ok() ? absl::InternalError("it failed") : why);
  // Meetings of the execution waiting for it now fail; their members wake (they wait for `done`).
  for (auto& [key, meeting] : meetings_) {
    if (meeting->done || meeting->execution != execution) continue;
    absl::Status failed = WithdrawnLocked(*meeting);
    if (failed.ok()) continue;
    meeting->done = true;
    meeting->withdrawn = true;
    meeting->status = absl::Status(failed.code(), absl::StrCat("collective call ", key, ": ", failed.message()));
  }
}

void CollectiveHub::ForgetWithdrawalsLocked(absl::Time now) {
  while (!withdrawn_order_.empty() &&
         (withdrawn_order_.size() > kMaxWithdrawals || now - withdrawn_order_.front().first > 2 * timeout_)) {
    withdrawn_.erase(withdrawn_order_.front().second);
    withdrawn_order_.pop_front();
  }
}

int CollectiveHub::WithdrawnAwayLocked(const Meeting& meeting) {
  auto it = withdrawn_.find(meeting.execution);
  if (it == withdrawn_.end()) return 0;
  int away = 0;
  for (const auto& [rank, shard] : meeting.local) away += meeting.calls[rank] == nullptr && it->second.contains(shard);
  return away;
}

absl::Status CollectiveHub::WithdrawnLocked(const Meeting& meeting) {
  auto it = withdrawn_.find(meeting.execution);
  if (it == withdrawn_.end()) return absl::OkStatus();
  for (const auto& [rank, shard] : meeting.local) {
    if (meeting.calls[rank] != nullptr) continue;  // here already: it withdrew after this call
    auto w = it->second.find(shard);
    if (w != it->second.end()) return WillNotCome(host_, shard, w->second);
  }
  return absl::OkStatus();
}

absl::Status CollectiveHub::Meet(const GroupPlacement& placement, const std::string& execution,
                                 const std::string& call_key, const CallId& id, const CollectiveCall& call) {
  const Group& group = placement.group;
  const int local_members = static_cast<int>(placement.local.size());
  const size_t size = group.shards.size();
  const auto named = [&] { return absl::StrCat("collective ", Describe(call), " ", group.label, ", call ", call_key); };
  // A member alone on its host needs no meeting.
  if (local_members == 1) {
    std::vector<const CollectiveCall*> calls(size, nullptr);
    calls[group.rank] = &call;
    absl::Status status = Perform(placement, call_key, id, calls, Alone);
    if (!status.ok()) LogFailure(host_, status);
    return status;
  }
  std::shared_ptr<Meeting> meeting;
  bool leader = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::CancelledError(absl::StrCat(named(), ": host ", host_, " is shutting down"));
    std::shared_ptr<Meeting>& slot = meetings_[call_key];
    if (slot == nullptr) {
      std::vector<std::pair<int, int64_t>> local;
      for (int r : placement.local) local.emplace_back(r, group.shards[r]);
      slot = std::make_shared<Meeting>(size, execution, std::move(local));
    }
    meeting = slot;
    meeting->calls[group.rank] = &call;
    if (!meeting->done) {
      if (absl::Status failed = WithdrawnLocked(*meeting); !failed.ok()) {
        meeting->done = true;
        meeting->withdrawn = true;
        meeting->status = absl::Status(failed.code(), absl::StrCat(named(), ": ", failed.message()));
      }
    }
    leader = ++meeting->arrived == local_members && !meeting->done;
  }
  if (leader) {
    // Every local member is blocked below until done, so their buffers stay valid.
    absl::Status status = Perform(placement, call_key, id, meeting->calls,
                                  [&](int n, absl::FunctionRef<absl::Status(int)> part) {
                                    return n > 1 ? ShareOut(*meeting, n, part) : Alone(n, part);
                                  });
    if (!status.ok()) LogFailure(host_, status);
    absl::MutexLock lock(&mu_);
    if (!meeting->done) {
      meeting->done = true;
      meeting->status = status;
    }
  }
  absl::MutexLock lock(&mu_);
  auto met = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return meeting->done || meeting->arrived == local_members || stopping_;
  };
  if (mu_.AwaitWithTimeout(absl::Condition(&met), timeout_) && stopping_ && !meeting->done &&
      meeting->arrived < local_members) {
    meeting->done = true;
    meeting->status = absl::CancelledError(absl::StrCat(named(), ": host ", host_, " is shutting down"));
  } else if (!meeting->done && meeting->arrived < local_members) {
    meeting->done = true;  // a member that comes later finds it so, and does not lead
    meeting->status = absl::DeadlineExceededError(
        absl::StrCat(named(), ": ", meeting->arrived, " of ", local_members, " members on host ", host_,
                     " met within ", absl::FormatDuration(timeout_),
                     "; gangs that share devices may have been ordered differently on them"));
    LogFailure(host_, meeting->status);
  }
  // Once all are here the leader works in every member's buffers: nobody leaves before it is
  // done (its cross-host part is bounded by its own deadline). Meanwhile the others take the
  // parts of its work that it shares out.
  auto done_or_work = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return meeting->done || (meeting->work != nullptr && meeting->next_part < meeting->parts);
  };
  for (;;) {
    mu_.Await(absl::Condition(&done_or_work));
    if (meeting->done) break;
    const int part = meeting->next_part++;
    const absl::FunctionRef<void(int)>& work = *meeting->work;  // stays until every part is done
    mu_.Unlock();
    work(part);
    mu_.Lock();
    ++meeting->parts_done;
  }
  absl::Status status = meeting->status;
  // The first member out of a meeting that failed for a withdrawn mate tells the group's other
  // hosts, whose members would otherwise wait for this host's leader until their deadline.
  const bool tell = meeting->withdrawn && !meeting->told && placement.hosts.size() > 1 && links_ != nullptr;
  meeting->told = meeting->told || tell;
  // A meeting goes once every member here has left it, those that withdrew counting as left: one
  // meeting per call, so a mate that comes later finds it failed (and told) already.
  ++meeting->left;
  if (meeting->left + (meeting->withdrawn ? WithdrawnAwayLocked(*meeting) : 0) >= local_members) {
    auto it = meetings_.find(call_key);
    if (it != meetings_.end() && it->second == meeting) meetings_.erase(it);
  }
  if (tell) {
    mu_.Unlock();
    links_->Abandon(placement.hosts, placement.mine, placement.devices, id, status);
    mu_.Lock();
  }
  return status;
}

absl::Status CollectiveHub::ShareOut(Meeting& meeting, int n, absl::FunctionRef<absl::Status(int)> part) {
  std::vector<absl::Status> results(n);
  auto run = [&](int p) { results[p] = part(p); };
  const absl::FunctionRef<void(int)> work(run);
  absl::MutexLock lock(&mu_);
  meeting.work = &work;
  meeting.parts = n;
  meeting.next_part = meeting.parts_done = 0;
  while (meeting.next_part < meeting.parts) {
    const int p = meeting.next_part++;
    mu_.Unlock();
    work(p);
    mu_.Lock();
    ++meeting.parts_done;
  }
  auto all_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return meeting.parts_done == meeting.parts; };
  mu_.Await(absl::Condition(&all_done));
  meeting.work = nullptr;
  meeting.parts = 0;
  for (const absl::Status& r : results) {
    if (!r.ok()) return r;
  }
  return absl::OkStatus();
}

void CollectiveHub::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (links_ != nullptr) links_->StopWaiting();
}

absl::Status CollectiveHub::Perform(const GroupPlacement& plan, const std::string& call_key, const CallId& id,
                                    const std::vector<const CollectiveCall*>& calls, Share share) {
  const size_t size = plan.group.shards.size();
  const bool cross = plan.hosts.size() > 1;

  // The local members must agree; the other hosts' agreement is checked by the signature every
  // message carries.
  const CollectiveCall& c = *calls[plan.local.front()];
  auto fail = [&](absl::StatusCode code, absl::string_view why) {
    return absl::Status(code, absl::StrCat("collective ", Describe(c), " ", plan.group.label, ", call ", call_key,
                                           ": ", why));
  };
  for (int r : plan.local) {
    if (!SameCall(*calls[r], c)) {
      // Found here alone: the other hosts are told why, not left to wait for this host until their
      // deadline. (What follows every host finds by itself.)
      const std::string why = absl::StrCat("members disagree: rank ", plan.local.front(), " calls ", Describe(c),
                                           ", rank ", r, " calls ", Describe(*calls[r]));
      if (cross && links_ != nullptr) {
        links_->Abandon(plan.hosts, plan.mine, plan.devices, id, absl::InvalidArgumentError(why));
      }
      return fail(absl::StatusCode::kInvalidArgument, why);
    }
  }
  const size_t element = DTypeSize(c.dtype);
  if (element == 0) return fail(absl::StatusCode::kInvalidArgument, "invalid dtype");
  const size_t bytes = c.count * element;
  if ((c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllToAll) && c.count % size != 0) {
    return fail(absl::StatusCode::kInvalidArgument,
                absl::StrCat(c.count, " elements do not split into ", size, " equal chunks"));
  }
  if (c.kind == CollectiveKind::kBroadcast && (c.root < 0 || c.root >= static_cast<int>(size))) {
    return fail(absl::StatusCode::kInvalidArgument,
                absl::StrCat("root ", c.root, " is not a member of a group of ", size));
  }
  if (cross && links_ == nullptr) {
    return fail(absl::StatusCode::kUnimplemented, absl::StrCat("host ", host_, " has no cross-host collectives"));
  }
  // What the members must agree on, as SameCall checks it locally.
  const bool reduces = c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter;
  const int64_t what[] = {static_cast<int64_t>(c.kind),
                          static_cast<int64_t>(c.dtype),
                          reduces ? static_cast<int64_t>(c.op) : -1,
                          c.kind == CollectiveKind::kBroadcast ? c.root : -1,
                          static_cast<int64_t>(c.count),
                          c.kind == CollectiveKind::kRoll ? c.shift : 0};
  const uint32_t signature =
      static_cast<uint32_t>(Fnv64(absl::string_view(reinterpret_cast<const char*>(what), sizeof(what))));
  // Runs the cross-host part on the group's mesh (connections are kept per set of devices).
  auto across = [&](auto&& body) -> absl::Status {
    absl::Status s = links_->Run(plan.hosts, plan.mine, plan.devices, id, absl::Now() + timeout_, [&](PeerMesh& mesh) {
      MeshSteps steps(mesh, id, signature, absl::Now() + timeout_);
      return body(steps);
    });
    if (s.ok()) return s;
    return fail(s.code(), absl::StrCat("across hosts [", absl::StrJoin(plan.hosts, ", "), "]: ", s.message()));
  };
  // The ranges of a buffer of `size` chunks of `chunk` bytes that each host's members own.
  auto owned = [&](char* buf, size_t chunk) {
    Segments segments(plan.hosts.size());
    for (size_t r = 0; r < size; ++r) AddPiece(segments[plan.host_of[r]], buf + r * chunk, chunk);
    return segments;
  };
  const int first = plan.local.front();
  // Large calls share their local copies and reductions among this host's members: one part each.
  const int parts = plan.local.size() > 1 && bytes >= kShareBytes ? static_cast<int>(plan.local.size()) : 1;
  // Elements [from, from + n) of every local input, reduced into `out` (at least two members).
  auto reduce_inputs = [&](size_t from, size_t n, char* out) -> absl::Status {
    const size_t at = from * element;
    PW_RETURN_IF_ERROR(Reduce(c.dtype, c.op, calls[plan.local[0]]->in + at, calls[plan.local[1]]->in + at, out, n));
    for (size_t i = 2; i < plan.local.size(); ++i) {
      PW_RETURN_IF_ERROR(ReduceInto(c.dtype, c.op, out, calls[plan.local[i]]->in + at, n));
    }
    return absl::OkStatus();
  };
  // Every element of every local input reduced into `acc`, in parts shared out when large.
  auto reduce_all_into = [&](char* acc) {
    return share(parts, [&](int p) {
      const auto [lo, hi] = PartOf(c.count, parts, p);
      return reduce_inputs(lo, hi - lo, acc + lo * element);
    });
  };
  // The first member's output, `n` bytes at `src`, into every other local member's output.
  auto copy_out = [&](const char* src, size_t n) -> absl::Status {
    if (plan.local.size() == 1) return absl::OkStatus();
    return share(parts, [&](int p) {
      const auto [lo, hi] = PartOf(n, parts, p);
      for (size_t i = 1; i < plan.local.size(); ++i) std::memcpy(calls[plan.local[i]]->out + lo, src + lo, hi - lo);
      return absl::OkStatus();
    });
  };
  // One step in which this host swaps with each other host h the pieces `fill(h, t)` lists in
  // t.send and t.recv (hosts with nothing to swap exchange no message).
  auto swap_with_each_host = [&](const std::function<void(int h, PeerTransfer& t)>& fill) {
    return across([&](MeshSteps& s) {
      std::vector<PeerTransfer> transfers;
      for (int h = 0; h < static_cast<int>(plan.hosts.size()); ++h) {
        if (h == plan.mine) continue;
        PeerTransfer t;
        t.peer = h;
        fill(h, t);
        if (!t.send.empty() || !t.recv.empty()) transfers.push_back(std::move(t));
      }
      return s.Step(transfers);
    });
  };

  switch (c.kind) {
    case CollectiveKind::kAllReduce: {
      // The host's partial result: the only member's input as it is, or the local inputs reduced
      // into the first member's output.
      char* acc = c.out;
      const char* partial = c.in;
      if (plan.local.size() > 1) {
        PW_RETURN_IF_ERROR(reduce_all_into(acc));
        partial = acc;
      }
      if (cross) {
        PW_RETURN_IF_ERROR(
            across([&](MeshSteps& s) { return AllReduceAcrossHosts(s, c.dtype, c.op, partial, acc, c.count); }));
      } else if (partial != acc) {
        std::memcpy(acc, partial, bytes);  // a group of one
      }
      return copy_out(acc, bytes);
    }
    case CollectiveKind::kAllGather: {
      char* buf = c.out;
      for (int r : plan.local) std::memcpy(buf + r * bytes, calls[r]->in, bytes);
      if (cross) PW_RETURN_IF_ERROR(across([&](MeshSteps& s) { return AllGatherAcrossHosts(s, owned(buf, bytes)); }));
      return copy_out(buf, bytes * size);
    }
    case CollectiveKind::kReduceScatter: {
      const size_t chunk = bytes / size;
      if (!cross) {
        // Each member's chunk is reduced straight into its output (shared out, when large).
        if (plan.local.size() == 1) {
          std::memcpy(c.out, c.in + first * chunk, chunk);  // a group of one
          return absl::OkStatus();
        }
        auto by_member = [&](int p) {
          const int r = plan.local[p];
          return reduce_inputs(r * (c.count / size), c.count / size, calls[r]->out);
        };
        const int members = static_cast<int>(plan.local.size());
        return parts > 1 ? share(members, by_member) : Alone(members, by_member);
      }
      // The host's partial sums of every chunk, in memory this thread keeps for its next call
      // (a fresh buffer would be page-faulted in every time), up to 16 MiB: host memory outside
      // the device's budget, so a larger one is the call's alone.
      thread_local std::vector<char> kept;
      std::vector<char> once;
      std::vector<char>& room = bytes <= (size_t{16} << 20) ? kept : once;
      if (room.size() < std::max<size_t>(bytes, 1)) room.resize(std::max<size_t>(bytes, 1));
      char* acc = room.data();
      if (plan.local.size() == 1) {
        std::memcpy(acc, c.in, bytes);
      } else {
        PW_RETURN_IF_ERROR(reduce_all_into(acc));
      }
      PW_RETURN_IF_ERROR(across([&](MeshSteps& s) {
        return ReduceScatterAcrossHosts(s, c.dtype, c.op, acc, c.count, owned(acc, chunk));
      }));
      for (int r : plan.local) std::memcpy(calls[r]->out, acc + r * chunk, chunk);
      return absl::OkStatus();
    }
    case CollectiveKind::kAllToAll: {
      // Chunk j of member i becomes chunk i of member j's output.
      const size_t chunk = bytes / size;
      for (int i : plan.local) {
        for (int j : plan.local) std::memcpy(calls[j]->out + i * chunk, calls[i]->in + j * chunk, chunk);
      }
      if (!cross) return absl::OkStatus();
      // Host a's block for host b: chunk j of each member i on a, for each member j on b,
      // enumerated (i, j) by rank on every host, straight from the inputs into the outputs.
      const int hosts = static_cast<int>(plan.hosts.size());
      std::vector<size_t> members(hosts, 0);
      for (size_t r = 0; r < size; ++r) ++members[plan.host_of[r]];
      std::vector<std::vector<Piece>> send(hosts), recv(hosts);
      for (int i : plan.local) {
        for (size_t j = 0; j < size; ++j) {
          if (plan.host_of[j] != plan.mine) AddPiece(send[plan.host_of[j]], calls[i]->in + j * chunk, chunk);
        }
      }
      for (size_t i = 0; i < size; ++i) {
        if (plan.host_of[i] == plan.mine) continue;
        for (int j : plan.local) AddPiece(recv[plan.host_of[i]], calls[j]->out + i * chunk, chunk);
      }
      // The largest block is between the two hosts with the most members (never a host and itself).
      std::vector<size_t> most = members;
      std::partial_sort(most.begin(), most.begin() + 2, most.end(), std::greater<>());
      const SmallAlgorithm algorithm = ChooseAllToAll(hosts, most[0] * most[1] * chunk);
      return across([&](MeshSteps& s) {
        return AllToAllAcrossHosts(
            s, send, recv, [&](int a, int b) { return members[a] * members[b] * chunk; }, algorithm);
      });
    }
    case CollectiveKind::kBroadcast: {
      char* buf = calls[first]->out;
      if (plan.host_of[c.root] == plan.mine) std::memcpy(buf, calls[c.root]->in, bytes);
      if (cross) {
        PW_RETURN_IF_ERROR(
            across([&](MeshSteps& s) { return BroadcastAcrossHosts(s, plan.host_of[c.root], buf, bytes); }));
      }
      return copy_out(buf, bytes);
    }
    case CollectiveKind::kRoll: {
      // Member r gets member (r - shift) mod G's input: copied when both are on this host, else
      // straight from the sender's input into the receiver's output, one message per pair of
      // hosts that exchange, enumerated by the receiving rank on both sides.
      const int64_t n = static_cast<int64_t>(size);
      const int64_t shift = ((c.shift % n) + n) % n;
      auto source = [&](int64_t r) { return static_cast<int>((r - shift + n) % n); };
      for (int r : plan.local) {
        if (plan.host_of[source(r)] == plan.mine) std::memcpy(calls[r]->out, calls[source(r)]->in, bytes);
      }
      if (!cross) return absl::OkStatus();
      return swap_with_each_host([&](int h, PeerTransfer& t) {
        for (int64_t r = 0; r < n; ++r) {
          if (plan.host_of[r] == h && plan.host_of[source(r)] == plan.mine) AddPiece(t.send, calls[source(r)]->in, bytes);
        }
        for (int r : plan.local) {
          if (plan.host_of[source(r)] == h) AddPiece(t.recv, calls[r]->out, bytes);
        }
      });
    }
  }
  return fail(absl::StatusCode::kInvalidArgument, "unknown collective");
}

namespace {
thread_local ShardCollectives* current_shard = nullptr;
}  // namespace

ShardCollectives::ShardCollectives(CollectiveHub& hub, std::shared_ptr<const GangLayout> layout, Execution execution,
                                   int64_t shard)
    : hub_(hub), layout_(std::move(layout)), execution_(execution), shard_(shard) {}

std::string ShardCollectives::ExecutionKey(const Execution& execution) {
  return absl::StrCat(*execution.client, "/", execution.program, "/", execution.run, "/", execution.node);
}

absl::StatusOr<const GroupPlacement*> ShardCollectives::PlacementFor(absl::string_view axes) {
  for (const auto& [a, g] : groups_) {
    if (a == axes) return g.get();
  }
  PW_ASSIGN_OR_RETURN(GroupPlacement placement, PlaceGroup(*layout_, shard_, axes, hub_.host()));
  groups_.emplace_back(std::string(axes), std::make_unique<GroupPlacement>(std::move(placement)));
  return groups_.back().second.get();
}

absl::StatusOr<int> ShardCollectives::GroupSize(absl::string_view axes) {
  PW_ASSIGN_OR_RETURN(const GroupPlacement* placement, PlacementFor(axes));
  return static_cast<int>(placement->group.shards.size());
}

absl::Status ShardCollectives::Run(absl::string_view axes, const CollectiveCall& call) {
  absl::Status status = [&]() -> absl::Status {
    PW_ASSIGN_OR_RETURN(const GroupPlacement* placement, PlacementFor(axes));
    // Every member makes the same calls in the same order (SPMD), so the call index matches.
    if (execution_key_.empty()) execution_key_ = ExecutionKey(execution_);
    const CallId id{Fnv64(absl::StrCat(execution_key_, "/", placement->group.id)), static_cast<uint32_t>(calls_)};
    const std::string call_key = absl::StrCat(execution_key_, "/", calls_++, "/", placement->group.id);
    return hub_.Run(*placement, execution_key_, call_key, id, call);
  }();
  if (!status.ok() && first_error_.ok()) first_error_ = status;
  return status;
}

ShardCollectives* ShardCollectives::Current() { return current_shard; }

ScopedShardCollectives::ScopedShardCollectives(ShardCollectives* shard) : previous_(current_shard) {
  current_shard = shard;
}

ScopedShardCollectives::~ScopedShardCollectives() { current_shard = previous_; }

}  // namespace pathways::collective
