#include "collective/collective.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

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
    return absl::DeadlineExceededError(absl::StrCat("rendezvous key '", key, "' not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  return values_.at(key);
}

absl::StatusOr<Group> GroupOf(const GangLayout& layout, int64_t shard, absl::string_view axes) {
  const int rank_count = static_cast<int>(layout.mesh_dims.size());
  std::vector<int> named;
  if (absl::StripAsciiWhitespace(axes).empty()) {
    for (int a = 0; a < rank_count; ++a) named.push_back(a);
  } else {
    for (absl::string_view name : absl::StrSplit(axes, ',')) {
      name = absl::StripAsciiWhitespace(name);
      auto it = std::find(layout.axis_names.begin(), layout.axis_names.end(), name);
      if (it == layout.axis_names.end()) {
        return absl::InvalidArgumentError(absl::StrCat("collective over unknown mesh axis '", name,
                                                       "'; the mesh has axes [",
                                                       absl::StrJoin(layout.axis_names, ", "), "]"));
      }
      int a = static_cast<int>(it - layout.axis_names.begin());
      if (std::find(named.begin(), named.end(), a) != named.end()) {
        return absl::InvalidArgumentError(absl::StrCat("collective names mesh axis '", name, "' twice"));
      }
      named.push_back(a);
    }
  }
  int64_t total = 1;
  for (int64_t d : layout.mesh_dims) total *= d;
  if (shard < 0 || shard >= total || static_cast<int64_t>(layout.members.size()) != total) {
    return absl::InternalError(absl::StrCat("shard ", shard, " is not in a gang of ", layout.members.size(),
                                            " members over ", total, " mesh positions"));
  }
  // Row-major coordinates of the calling shard.
  std::vector<int64_t> coords(rank_count);
  for (int a = rank_count - 1; a >= 0; --a) {
    coords[a] = shard % layout.mesh_dims[a];
    shard /= layout.mesh_dims[a];
  }
  Group group;
  for (int a = 0; a < rank_count; ++a) {
    if (std::find(named.begin(), named.end(), a) == named.end()) absl::StrAppend(&group.id, a, "=", coords[a], ";");
  }
  int64_t size = 1;
  for (int a : named) size *= layout.mesh_dims[a];
  for (int64_t g = 0; g < size; ++g) {
    std::vector<int64_t> c = coords;
    bool is_me = true;
    int64_t rest = g;
    for (int k = static_cast<int>(named.size()) - 1; k >= 0; --k) {
      c[named[k]] = rest % layout.mesh_dims[named[k]];
      rest /= layout.mesh_dims[named[k]];
      if (c[named[k]] != coords[named[k]]) is_me = false;
    }
    int64_t linear = 0;
    for (int a = 0; a < rank_count; ++a) linear = linear * layout.mesh_dims[a] + c[a];
    if (is_me) group.rank = static_cast<int>(g);
    group.shards.push_back(linear);
  }
  return group;
}

struct CollectiveHub::Meeting {
  explicit Meeting(size_t size, int local) : parts(size), local_members(local) {}
  std::vector<std::shared_ptr<const std::string>> parts;
  const int local_members;
  int arrived = 0;
  int left = 0;
  bool done = false;
  absl::Status status;
};

CollectiveHub::CollectiveHub(std::string host, std::unique_ptr<CrossHostExchange> cross_host,
                             absl::Duration timeout)
    : host_(std::move(host)), cross_host_(std::move(cross_host)), timeout_(timeout) {}

absl::StatusOr<Exchanged> CollectiveHub::Exchange(const GangLayout& layout, const Group& group,
                                                  const std::string& call_key, std::string bytes) {
  int local_members = 0;
  bool spans_hosts = false;
  for (int64_t s : group.shards) {
    if (layout.members[s].host == host_) {
      ++local_members;
    } else {
      spans_hosts = true;
    }
  }
  std::shared_ptr<Meeting> meeting;
  bool leader = false;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Meeting>& slot = meetings_[call_key];
    if (slot == nullptr) slot = std::make_shared<Meeting>(group.shards.size(), local_members);
    meeting = slot;
    meeting->parts[group.rank] = std::make_shared<const std::string>(std::move(bytes));
    leader = ++meeting->arrived == local_members && !meeting->done;
  }
  if (leader) {
    absl::Status status = spans_hosts ? CompleteAcrossHosts(layout, group, call_key, *meeting) : absl::OkStatus();
    absl::MutexLock lock(&mu_);
    if (!meeting->done) {
      meeting->done = true;
      meeting->status = status;
    }
  }
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(&meeting->done), timeout_)) {
    meeting->done = true;
    meeting->status = absl::DeadlineExceededError(
        absl::StrCat("collective ", call_key, ": ", meeting->arrived, " of ", local_members, " members on host ",
                     host_, spans_hosts ? " (and the group's other hosts)" : "", " met within ",
                     absl::FormatDuration(timeout_),
                     "; gangs that share devices may have been ordered differently on them"));
  }
  Exchanged result;
  result.rank = group.rank;
  if (meeting->status.ok()) result.parts = meeting->parts;
  absl::Status status = meeting->status;
  if (++meeting->left == meeting->local_members) {
    auto it = meetings_.find(call_key);
    if (it != meetings_.end() && it->second == meeting) meetings_.erase(it);
  }
  if (!status.ok()) return status;
  return result;
}

absl::Status CollectiveHub::CompleteAcrossHosts(const GangLayout& layout, const Group& group,
                                                const std::string& call_key, Meeting& meeting) {
  if (cross_host_ == nullptr) {
    return absl::UnimplementedError(absl::StrCat("host ", host_, " has no cross-host collectives; group of ",
                                                 call_key, " spans hosts"));
  }
  std::vector<std::string> hosts;
  std::vector<std::string> devices;
  for (int64_t s : group.shards) {
    hosts.push_back(layout.members[s].host);
    devices.push_back(absl::StrCat(layout.members[s].host, "/", layout.members[s].device));
  }
  std::sort(hosts.begin(), hosts.end());
  hosts.erase(std::unique(hosts.begin(), hosts.end()), hosts.end());
  std::sort(devices.begin(), devices.end());
  const int mine = static_cast<int>(std::find(hosts.begin(), hosts.end(), host_) - hosts.begin());
  // This host's parts, in rank order; every part has the same size (SPMD: same local shapes).
  std::string local;
  size_t part_bytes = 0;
  bool first = true;
  for (size_t r = 0; r < group.shards.size(); ++r) {
    if (layout.members[group.shards[r]].host != host_) continue;
    const std::string& part = *meeting.parts[r];
    if (first) part_bytes = part.size();
    first = false;
    if (part.size() != part_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("collective ", call_key, ": members contribute ", part_bytes,
                                                     " and ", part.size(), " bytes; all must contribute the same"));
    }
    local += part;
  }
  // FNV-1a: the tag must be the same in every process (absl::Hash is seeded per process).
  uint32_t tag = 2166136261u;
  for (unsigned char ch : call_key) tag = (tag ^ ch) * 16777619u;
  auto blobs = cross_host_->AllGather(hosts, mine, absl::StrJoin(devices, ","), tag, local, timeout_);
  if (!blobs.ok()) {
    return absl::Status(blobs.status().code(),
                        absl::StrCat("collective ", call_key, " across hosts: ", blobs.status().message()));
  }
  // Split each host's blob back into its members' parts.
  std::vector<size_t> offset(hosts.size(), 0);
  for (size_t r = 0; r < group.shards.size(); ++r) {
    const std::string& h = layout.members[group.shards[r]].host;
    const size_t hi = std::find(hosts.begin(), hosts.end(), h) - hosts.begin();
    if (h == host_) continue;
    const std::string& blob = (*blobs)[hi];
    if (offset[hi] + part_bytes > blob.size()) {
      return absl::InvalidArgumentError(absl::StrCat("collective ", call_key, ": host ", h,
                                                     " contributed fewer bytes than ", part_bytes, " per member"));
    }
    meeting.parts[r] = std::make_shared<const std::string>(blob.substr(offset[hi], part_bytes));
    offset[hi] += part_bytes;
  }
  return absl::OkStatus();
}

namespace {
thread_local ShardCollectives* current_shard = nullptr;
}  // namespace

ShardCollectives::ShardCollectives(CollectiveHub& hub, std::shared_ptr<const GangLayout> layout, Execution execution,
                                   int64_t shard)
    : hub_(hub), layout_(std::move(layout)), execution_(execution), shard_(shard) {}

absl::StatusOr<Exchanged> ShardCollectives::Exchange(absl::string_view axes, std::string bytes) {
  auto result = [&]() -> absl::StatusOr<Exchanged> {
    auto group = GroupOf(*layout_, shard_, axes);
    if (!group.ok()) return group.status();
    // Every member makes the same calls in the same order (SPMD), so the call index matches.
    if (execution_key_.empty()) {
      execution_key_ = absl::StrCat(*execution_.client, "/", execution_.program, "/", execution_.run, "/", execution_.node);
    }
    std::string call_key = absl::StrCat(execution_key_, "/", calls_++, "/", group->id);
    return hub_.Exchange(*layout_, *group, call_key, std::move(bytes));
  }();
  if (!result.ok() && first_error_.ok()) first_error_ = result.status();
  return result;
}

ShardCollectives* ShardCollectives::Current() { return current_shard; }

ScopedShardCollectives::ScopedShardCollectives(ShardCollectives* shard) : previous_(current_shard) {
  current_shard = shard;
}

ScopedShardCollectives::~ScopedShardCollectives() { current_shard = previous_; }

}  // namespace pathways::collective
