#include "collective/collective.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/collective_internal.h"
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

uint64_t Fnv64(absl::string_view s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

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

namespace {

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

// Axes beyond which a withdrawal looks only at the group over every axis (2^axes groups a shard).
constexpr size_t kMaxAxesLookedAt = 6;

}  // namespace

// Only the groups' members are worked out here: a group's placement (Placed; its mesh's key names every
// member's device) is made once the group turns out to have no member left on this host.
std::vector<CollectiveHub::GroupAcross> CollectiveHub::GroupsAcrossHosts(const GangLayout& layout, int64_t shard,
                                                                         const std::string& host) {
  std::vector<GroupAcross> groups;
  if (std::all_of(layout.members.begin(), layout.members.end(), [&](const Member& m) { return m.host == host; })) {
    return groups;
  }
  const size_t axes = layout.axis_names.size();
  const bool named = axes == layout.mesh_dims.size() && axes <= kMaxAxesLookedAt;
  for (uint32_t mask = named ? 1 : 0; mask < (named ? (1u << axes) : 1u); ++mask) {
    std::vector<absl::string_view> over;  // empty: every axis
    for (size_t a = 0; a < axes && named; ++a) {
      if ((mask >> a) & 1) over.push_back(layout.axis_names[a]);
    }
    GroupAcross g;
    g.axes = absl::StrJoin(over, ",");
    absl::StatusOr<Group> group = GroupOf(layout, shard, g.axes);
    if (!group.ok()) continue;
    bool spans = false;
    for (int64_t s : group->shards) {
      if (layout.members[s].host == host) {
        g.here.push_back(s);
      } else {
        spans = true;
      }
    }
    g.group_id = std::move(group->id);
    if (spans) groups.push_back(std::move(g));
  }
  return groups;
}

namespace {

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

absl::StatusOr<std::shared_ptr<const GroupPlacement>> CollectiveHub::Placed(
    const std::shared_ptr<const GangLayout>& layout, int64_t shard, absl::string_view axes) {
  std::pair<int64_t, std::string> key(shard, CanonicalAxes(axes));
  {
    absl::MutexLock lock(&placed_mu_);
    if (auto gang = placed_.find(layout.get()); gang != placed_.end()) {
      if (auto it = gang->second.groups.find(key); it != gang->second.groups.end()) return it->second;
    }
  }
  PW_ASSIGN_OR_RETURN(GroupPlacement placed, PlaceGroup(*layout, shard, axes, host_));
  auto placement = std::make_shared<const GroupPlacement>(std::move(placed));
  absl::MutexLock lock(&placed_mu_);
  if (placed_groups_ >= kMaxPlaced) {
    for (auto it = placed_.begin(); it != placed_.end();) {
      if (it->second.layout.use_count() == 1) {  // no run holds its layout any more
        placed_groups_ -= it->second.groups.size();
        placed_.erase(it++);
      } else {
        ++it;
      }
    }
    if (placed_groups_ >= kMaxPlaced) {
      placed_.clear();
      placed_groups_ = 0;
    }
  }
  PlacedGang& gang = placed_[layout.get()];
  if (gang.layout == nullptr) gang.layout = layout;
  if (gang.groups.try_emplace(std::move(key), placement).second) ++placed_groups_;
  return placement;
}

CollectiveHub::Stats CollectiveHub::stats() const {
  Stats s;
  s.failed = failed_.load(std::memory_order_relaxed);
  s.calls = ok_.load(std::memory_order_relaxed) + s.failed;
  for (size_t i = 0; i < s.latency_buckets.size(); ++i) s.latency_buckets[i] = latency_buckets_[i].load(std::memory_order_relaxed);
  s.latency_sum_us = latency_sum_us_.load(std::memory_order_relaxed);
  s.in_progress = in_progress_.load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  s.meetings = static_cast<int64_t>(meetings_.size());
  return s;
}

void CollectiveHub::Withdraw(const std::shared_ptr<const GangLayout>& layout, const std::string& execution,
                             int64_t shard, int calls, const absl::Status& why) {
  // Worked out before the lock is taken: every collective call on the host takes it.
  std::vector<GroupAcross> across =
      links_ != nullptr ? GroupsAcrossHosts(*layout, shard, host_) : std::vector<GroupAcross>();
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    ForgetWithdrawalsLocked(now);
    auto [it, first] = withdrawn_.try_emplace(execution);
    if (first) withdrawn_order_.emplace_back(now, execution);
    it->second.try_emplace(shard, Withdrawn{why.ok() ? absl::InternalError("it failed") : why, calls});
    // Meetings of the execution waiting for it now fail; their members wake (they wait for `done`).
    for (auto& [key, meeting] : meetings_) {
      if (meeting->done || meeting->execution != execution) continue;
      absl::Status failed = WithdrawnLocked(*meeting);
      if (failed.ok()) continue;
      meeting->done = true;
      meeting->withdrawn = true;
      meeting->status = absl::Status(failed.code(), absl::StrCat("collective call ", key, ": ", failed.message()));
    }
    MarkUnattendedLocked(across, execution);
  }
  std::vector<Withdrawal> unattended;
  for (GroupAcross& g : across) {
    if (!g.unattended) continue;
    absl::StatusOr<std::shared_ptr<const GroupPlacement>> placement = Placed(layout, shard, g.axes);
    if (!placement.ok()) continue;
    unattended.push_back(
        {Fnv64(absl::StrCat(execution, "/", g.group_id)), g.from_call, Fnv64((*placement)->devices), std::move(g.why)});
  }
  if (!unattended.empty()) links_->Withdrew(std::move(unattended));
}

// Members made different numbers of calls: the group misses this host from the most any made
// (earlier calls were met here, and failed or not there), and the one that made the fewest says
// why (the others most likely failed for it).
void CollectiveHub::MarkUnattendedLocked(std::vector<GroupAcross>& groups, const std::string& execution) {
  const auto& withdrawn = withdrawn_.at(execution);
  for (GroupAcross& g : groups) {
    int64_t first = -1;
    int fewest = 0, most = 0;
    g.unattended = true;
    for (int64_t s : g.here) {
      auto w = withdrawn.find(s);
      if (w == withdrawn.end()) {
        g.unattended = false;
        break;
      }
      if (first < 0 || w->second.calls < fewest) {
        first = s;
        fewest = w->second.calls;
      }
      most = std::max(most, w->second.calls);
    }
    if (!g.unattended) continue;
    g.from_call = static_cast<uint32_t>(most);
    g.why = WillNotCome(host_, first, withdrawn.at(first).why);
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
    if (w != it->second.end()) return WillNotCome(host_, shard, w->second.why);
  }
  return absl::OkStatus();
}

absl::Status CollectiveHub::Meet(const GroupPlacement& placement, const std::string& execution,
                                 const std::string& call_key, const CallId& id, const CollectiveCall& call) {
  const Group& group = placement.group;
  const int local_members = static_cast<int>(placement.local.size());
  const size_t size = group.shards.size();
  const auto named = [&] { return absl::StrCat("collective ", Describe(call), " ", group.label, ", call ", call_key); };
  if (absl::Status gone = GoneStatus(execution); !gone.ok()) {
    return absl::Status(gone.code(), absl::StrCat(named(), ": ", gone.message()));
  }
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
    for (const absl::Time now = absl::Now(); !timed_out_.empty() && now - timed_out_.front().first > 2 * timeout_;) {
      auto it = meetings_.find(timed_out_.front().second);
      if (it != meetings_.end() && it->second->done) meetings_.erase(it);  // its members hold their own reference
      timed_out_.pop_front();
    }
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
      } else if (absl::Status gone = GoneStatus(execution); !gone.ok()) {
        // Its client went away after the check above and before this meeting was there for
        // ClientGone to end: its mates will not come (they fail at that check).
        meeting->done = true;
        meeting->status = absl::Status(gone.code(), absl::StrCat(named(), ": ", gone.message()));
        timed_out_.emplace_back(absl::Now(), call_key);
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
    timed_out_.emplace_back(absl::Now(), call_key);
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

void CollectiveHub::ForgetGoneLocked(absl::Time now) {
  while (!gone_order_.empty() && (gone_order_.size() > kMaxGone || now - gone_order_.front().first > 2 * timeout_)) {
    gone_.erase(gone_order_.front().second);
    gone_order_.pop_front();
  }
  gone_count_.store(static_cast<int>(gone_.size()), std::memory_order_relaxed);
}

void CollectiveHub::ClientGone(const std::string& client, const absl::Status& why) {
  {
    absl::MutexLock lock(&gone_mu_);
    if (gone_.insert_or_assign(client, why).second) gone_order_.emplace_back(absl::Now(), client);
    ForgetGoneLocked(absl::Now());
  }
  // Meetings of its executions that still wait for a mate here end now. One whose members are all
  // here has a leader working in their buffers: its cross-host part ends by the check Perform
  // gives the mesh.
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto& [key, meeting] : meetings_) {
    if (meeting->done || meeting->arrived == static_cast<int>(meeting->local.size())) continue;
    const absl::string_view execution = meeting->execution;
    if (execution.substr(0, execution.find('/')) != client) continue;
    meeting->done = true;
    meeting->status = absl::Status(why.code(), absl::StrCat("collective call ", key, ": ", why.message()));
    timed_out_.emplace_back(now, key);
  }
}

absl::Status CollectiveHub::GoneStatus(absl::string_view key) {
  if (gone_count_.load(std::memory_order_relaxed) == 0) return absl::OkStatus();
  const absl::string_view client = key.substr(0, key.find('/'));
  absl::MutexLock lock(&gone_mu_);
  ForgetGoneLocked(absl::Now());
  auto it = gone_.find(client);
  return it == gone_.end() ? absl::OkStatus() : it->second;
}

void CollectiveHub::RunNotStarted(const std::string& client, int64_t program, int64_t run, const absl::Status& why) {
  if (links_ == nullptr) return;
  links_->RunNotStarted(
      ShardCollectives::RunTag(client, program, run), Fnv64(client),
      absl::Status(why.code(), absl::StrCat("host ", host_, " did not start the run (", why.message(), ")")));
}

void CollectiveHub::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (links_ != nullptr) links_->StopWaiting();
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

uint64_t ShardCollectives::RunTag(const std::string& client, int64_t program, int64_t run) {
  return Fnv64(absl::StrCat(client, "/", program, "/", run));
}

absl::StatusOr<const GroupPlacement*> ShardCollectives::PlacementFor(absl::string_view written) {
  // Kept by the axes' one spelling (CanonicalAxes), here and in the hub: a body that respells the
  // same axes call after call ("x", " x", "  x", ...) finds one entry, not a new one a call.
  for (const auto& [a, g] : groups_) {
    if (a == written) return g.get();
  }
  const std::string axes = CanonicalAxes(written);
  for (const auto& [a, g] : groups_) {
    if (a == axes) return g.get();
  }
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const GroupPlacement> placement, hub_.Placed(layout_, shard_, axes));
  groups_.emplace_back(axes, std::move(placement));
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
    if (execution_key_.empty()) {
      execution_key_ = ExecutionKey(execution_);
      run_tag_ = RunTag(*execution_.client, execution_.program, execution_.run);
    }
    const CallId id{Fnv64(absl::StrCat(execution_key_, "/", placement->group.id)), static_cast<uint32_t>(calls_),
                    run_tag_};
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
