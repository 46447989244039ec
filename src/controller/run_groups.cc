#include "controller/run_groups.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "transport/controller_client.h"

namespace pathways {

absl::Status RunGroupBook::Resolve(rpc::ScheduleRequest& request) {
  const bool grouped = std::any_of(request.runs().begin(), request.runs().end(),
                                   [](const rpc::GangRun& r) { return r.group() != 0; });
  if (!grouped) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  // Worked on copies of the groups the request touches, kept only if every run resolves (a copy
  // shares its hosts with the group kept until a run names them anew).
  absl::flat_hash_map<int64_t, Epoch> touched;
  size_t named = 0;  // hosts named for runs that named none
  const Groups* known = nullptr;
  if (auto it = clients_.find(request.client_id()); it != clients_.end()) known = &it->second;
  for (rpc::GangRun& run : *request.mutable_runs()) {
    if (run.group() == 0) continue;
    auto [it, is_new] = touched.try_emplace(run.group());
    Epoch& e = it->second;
    if (is_new && known != nullptr) {
      if (auto k = known->find(run.group()); k != known->end()) {
        e.epoch = k->second.epoch;
        e.last_run = k->second.last_run;
        e.base = k->second.base;
      }
    }
    if (run.hosts_size() > 0) {
      if (run.group_epoch() < e.epoch) continue;  // an older epoch's run: it names its hosts itself
      e.epoch = run.group_epoch();
      e.last_run = run.group_run();
      auto base = std::make_shared<std::vector<rpc::HostSeq>>(run.hosts().begin(), run.hosts().end());
      for (rpc::HostSeq& h : *base) h.set_seq(h.seq() - run.group_run());
      e.base = std::move(base);
      continue;
    }
    if (e.base == nullptr || e.base->empty() || run.group_epoch() != e.epoch || run.group_run() != e.last_run + 1) {
      return absl::AbortedError(absl::StrCat(kRunGroupOutOfStep, ": client ", request.client_id(), "'s run ",
                                             run.group_run(), " of group ", run.group(), " epoch ", run.group_epoch(),
                                             " does not follow a run this controller knows"));
    }
    named += e.base->size();
    if (named > kMaxHostsNamedPerRequest) {
      return absl::InvalidArgumentError(
          absl::StrCat("client ", request.client_id(), "'s schedule request would name more than ",
                       kMaxHostsNamedPerRequest, " hosts in all once its runs' groups are named; send fewer runs at once"));
    }
    e.last_run = run.group_run();
    run.mutable_hosts()->Reserve(static_cast<int>(e.base->size()));
    for (const rpc::HostSeq& b : *e.base) {
      rpc::HostSeq* h = run.add_hosts();
      *h = b;
      h->set_seq(b.seq() + run.group_run());
    }
  }
  Groups& groups = clients_[request.client_id()];
  for (auto& [group, e] : touched) {
    auto [it, is_new] = groups.try_emplace(group);
    Epoch& kept = it->second;
    if (is_new) {
      lru_.push_front({request.client_id(), group});
    } else {
      bytes_kept_ -= kept.bytes;
      lru_.splice(lru_.begin(), lru_, kept.lru);
    }
    kept.lru = lru_.begin();
    kept.used = ++clock_;
    kept.epoch = e.epoch;
    kept.last_run = e.last_run;
    if (is_new || kept.base != e.base) {  // an epoch named anew (a run that names no host shares it)
      kept.base = std::move(e.base);
      kept.bytes = 0;
      if (kept.base != nullptr) {
        for (const rpc::HostSeq& h : *kept.base) kept.bytes += h.host().size() + kHostOverheadBytes;
      }
    }
    bytes_kept_ += kept.bytes;
  }
  // The least recently used go first, this client's own before others' for its own bound.
  while (groups.size() > kMaxGroupsPerClient) {
    auto oldest = std::min_element(groups.begin(), groups.end(),
                                   [](const auto& a, const auto& b) { return a.second.used < b.second.used; });
    ForgetLocked(request.client_id(), oldest->first);
  }
  while (bytes_kept_ > kMaxBytesKept && !lru_.empty()) ForgetLocked(lru_.back().first, lru_.back().second);
  return absl::OkStatus();
}

void RunGroupBook::ForgetLocked(const std::string& client, int64_t group) {
  auto c = clients_.find(client);
  if (c == clients_.end()) return;
  auto g = c->second.find(group);
  if (g == c->second.end()) return;
  bytes_kept_ -= g->second.bytes;
  lru_.erase(g->second.lru);
  c->second.erase(g);
  if (c->second.empty()) clients_.erase(c);
}

void RunGroupBook::Forget(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  for (const auto& [group, e] : it->second) {
    bytes_kept_ -= e.bytes;
    lru_.erase(e.lru);
  }
  clients_.erase(it);
}

size_t RunGroupBook::bytes_kept() {
  absl::MutexLock lock(&mu_);
  return bytes_kept_;
}

}  // namespace pathways
