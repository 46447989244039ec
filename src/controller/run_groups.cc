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
  // Worked on copies of the groups the request touches, kept only if every run resolves.
  Groups touched;
  const Groups* known = nullptr;
  if (auto it = clients_.find(request.client_id()); it != clients_.end()) known = &it->second;
  for (rpc::GangRun& run : *request.mutable_runs()) {
    if (run.group() == 0) continue;
    auto [it, is_new] = touched.try_emplace(run.group());
    Epoch& e = it->second;
    if (is_new && known != nullptr) {
      if (auto k = known->find(run.group()); k != known->end()) e = k->second;
    }
    if (run.hosts_size() > 0) {
      if (run.group_epoch() < e.epoch) continue;  // an older epoch's run: it names its hosts itself
      e.epoch = run.group_epoch();
      e.last_run = run.group_run();
      e.base.assign(run.hosts().begin(), run.hosts().end());
      for (rpc::HostSeq& h : e.base) h.set_seq(h.seq() - run.group_run());
      continue;
    }
    if (e.base.empty() || run.group_epoch() != e.epoch || run.group_run() != e.last_run + 1) {
      return absl::AbortedError(absl::StrCat(kRunGroupOutOfStep, ": client ", request.client_id(), "'s run ",
                                             run.group_run(), " of group ", run.group(), " epoch ", run.group_epoch(),
                                             " does not follow a run this controller knows"));
    }
    e.last_run = run.group_run();
    run.mutable_hosts()->Reserve(static_cast<int>(e.base.size()));
    for (const rpc::HostSeq& b : e.base) {
      rpc::HostSeq* h = run.add_hosts();
      *h = b;
      h->set_seq(b.seq() + run.group_run());
    }
  }
  Groups& groups = clients_[request.client_id()];
  for (auto& [group, e] : touched) {
    e.used = ++clock_;
    Epoch& kept = groups[group];
    hosts_kept_ = hosts_kept_ - kept.base.size() + e.base.size();
    kept = std::move(e);
  }
  while (groups.size() > kMaxGroupsPerClient) ForgetOldestLocked(&groups);
  while (hosts_kept_ > kMaxHostsKept) ForgetOldestLocked(nullptr);
  return absl::OkStatus();
}

void RunGroupBook::ForgetOldestLocked(Groups* groups) {
  Groups* from = nullptr;
  Groups::iterator oldest;
  auto consider = [&](Groups& g) {
    for (auto it = g.begin(); it != g.end(); ++it) {
      if (from == nullptr || it->second.used < oldest->second.used) {
        from = &g;
        oldest = it;
      }
    }
  };
  if (groups != nullptr) {
    consider(*groups);
  } else {
    for (auto& [client, g] : clients_) consider(g);
  }
  if (from == nullptr) return;
  hosts_kept_ -= oldest->second.base.size();
  from->erase(oldest);
}

void RunGroupBook::Forget(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  for (const auto& [group, e] : it->second) hosts_kept_ -= e.base.size();
  clients_.erase(it);
}

size_t RunGroupBook::hosts_kept() {
  absl::MutexLock lock(&mu_);
  return hosts_kept_;
}

}  // namespace pathways
