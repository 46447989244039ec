#include "controller/schedule_admission.h"

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace pathways {

absl::StatusOr<std::vector<Future<Unit>>> ScheduleAdmission::Submit(const rpc::ScheduleRequest& request,
                                                                    absl::Time now) {
  if (request.client_id().empty()) return absl::InvalidArgumentError("schedule request has no client id");
  if (!(request.weight() >= 0) || request.weight() > max_weight_) {
    return absl::InvalidArgumentError(absl::StrCat("scheduling weight ", request.weight(), " is not in [0, ",
                                                   max_weight_, "], this cluster's range (--max-client-weight)"));
  }
  // A batch's runs name the same few hosts over and over: look each up once (its island, and
  // whether the client may use it at all).
  absl::flat_hash_map<std::string, absl::StatusOr<int32_t>> island_of;
  // Each run split by island, in the request's (the client's) order.
  std::vector<std::vector<std::pair<int, rpc::GangRun>>> runs;
  for (const rpc::GangRun& run : request.runs()) {
    if (run.hosts().empty()) return absl::InvalidArgumentError("a scheduled run names no hosts");
    std::map<int, rpc::GangRun> parts;
    for (const rpc::HostSeq& h : run.hosts()) {
      auto [it, is_new] = island_of.try_emplace(h.host(), 0);
      if (is_new) {
        // A host that is gone or not registered (yet) says so first.
        it->second = registry_.IslandOf(h.host(), now);
        if (it->second.ok()) {
          if (absl::Status may_use = registry_.CheckClientMayUse(request.client_id(), h.host()); !may_use.ok()) {
            it->second = may_use;
          }
        }
      }
      if (!it->second.ok()) return it->second.status();
      rpc::GangRun& part = parts[*it->second];
      if (!part.has_run()) *part.mutable_run() = run.run();
      *part.add_hosts() = h;
    }
    runs.emplace_back(std::make_move_iterator(parts.begin()), std::make_move_iterator(parts.end()));
  }
  // Runs within one island go to its scheduler in batches; a run over several islands goes to
  // all of them together, after this client's earlier runs on them (hosts apply a client's runs
  // in the client's order).
  std::vector<Future<Unit>> accepted;
  std::map<int, std::vector<rpc::GangRun>> batches;
  auto flush = [&](int island) {
    auto it = batches.find(island);
    if (it == batches.end()) return;
    accepted.push_back(sinks_.island(island, request.client_id(), request.weight(), std::move(it->second)));
    batches.erase(it);
  };
  for (auto& parts : runs) {
    if (parts.size() == 1) {
      batches[parts[0].first].push_back(std::move(parts[0].second));
      continue;
    }
    for (const auto& [island, part] : parts) flush(island);
    accepted.push_back(sinks_.across_islands(request.client_id(), request.weight(), std::move(parts)));
  }
  while (!batches.empty()) flush(batches.begin()->first);
  return accepted;
}

Future<Unit> ScheduleAdmission::SubmitOrHold(const rpc::ScheduleRequest& given, const std::string& tenant) {
  const absl::Time now = absl::Now();
  const absl::Status closed = absl::UnavailableError("the controller is shutting down");
  if (closed_.load()) return Future<Unit>::Ready(closed);
  // Runs that name only their group get their hosts here, once: a held request is tried again
  // as it is after this.
  const rpc::ScheduleRequest* named = &given;
  rpc::ScheduleRequest resolved;
  if (std::any_of(given.runs().begin(), given.runs().end(), [](const rpc::GangRun& r) { return r.group() != 0; })) {
    resolved = given;
    if (absl::Status s = groups_.Resolve(resolved); !s.ok()) return Future<Unit>::Ready(s);
    named = &resolved;
  }
  const rpc::ScheduleRequest& request = *named;
  // Without the lock: requests of many clients go through at once. One client's do not overtake
  // each other, since it sends its next once this one is answered.
  auto accepted = Submit(request, now);
  if (accepted.ok()) return AllDone(*accepted);
  if (!MayHold(accepted.status(), now)) return Future<Unit>::Ready(accepted.status());
  absl::MutexLock lock(&mu_);
  if (closed_.load()) return Future<Unit>::Ready(closed);
  const size_t bytes = request.ByteSizeLong();
  if (held_.size() >= kMaxHeld || held_bytes_ + bytes > kMaxHeldBytes) return Future<Unit>::Ready(accepted.status());
  held_bytes_ += bytes;
  held_.push_back({request, tenant, Promise<Unit>(), bytes});
  return held_.back().promise.future();
}

void ScheduleAdmission::RetryHeld(absl::Time now) {
  // Answered after the lock: continuations may run inline.
  std::vector<std::pair<Promise<Unit>, Future<Unit>>> answers;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      const absl::Status admitted = sinks_.still_admitted(it->request.client_id(), it->tenant);
      absl::StatusOr<std::vector<Future<Unit>>> accepted =
          admitted.ok() ? Submit(it->request, now) : absl::StatusOr<std::vector<Future<Unit>>>(admitted);
      if (!accepted.ok() && MayHold(accepted.status(), now)) {
        ++it;
        continue;
      }
      if (accepted.ok()) {
        answers.emplace_back(std::move(it->promise), AllDone(*accepted));
      } else {
        // A controller that restarted knows of a client's earlier slices only the hosts where it
        // holds something (arrays, programs, ops), as they register again.
        const bool unknown_slice = absl::IsPermissionDenied(accepted.status());
        answers.emplace_back(
            std::move(it->promise),
            Future<Unit>::Ready(absl::Status(
                accepted.status().code(),
                absl::StrCat(accepted.status().message(), " (still, after holding the request for hosts to register",
                             unknown_slice ? "; if the slice was made before the controller restarted, make it again"
                                           : "",
                             ")"))));
      }
      held_bytes_ -= it->bytes;
      it = held_.erase(it);
    }
  }
  for (auto& [promise, answer] : answers) {
    answer.OnReady([p = std::make_shared<Promise<Unit>>(std::move(promise))](const absl::StatusOr<Unit>& r) { p->Set(r); });
  }
}

void ScheduleAdmission::Close() {
  std::list<Held> held;
  {
    absl::MutexLock lock(&mu_);
    closed_.store(true);
    held.swap(held_);
    held_bytes_ = 0;
  }
  for (Held& h : held) h.promise.Set(absl::UnavailableError("the controller is shutting down"));
}

size_t ScheduleAdmission::num_held() {
  absl::MutexLock lock(&mu_);
  return held_.size();
}

}  // namespace pathways
