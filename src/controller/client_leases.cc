#include "controller/client_leases.h"

#include "absl/strings/str_cat.h"

namespace pathways {

void ClientLeases::Renew(const std::string& client, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Lease& lease = leases_[client];
  if (lease.departed != absl::InfiniteFuture()) return;  // gone is gone: its state is collected
  lease.last_seen = now;
}

void ClientLeases::Adopt(const std::string& client, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = leases_.try_emplace(client);
  if (inserted) it->second.last_seen = now;
}

void ClientLeases::Goodbye(const std::string& client, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Lease& lease = leases_[client];
  if (lease.departed == absl::InfiniteFuture()) lease.departed = now;
}

void ClientLeases::Refuse(const std::string& client, std::string reason, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Lease& lease = leases_[client];
  if (lease.departed == absl::InfiniteFuture()) lease.departed = now;
  lease.refused = std::move(reason);
}

absl::Status ClientLeases::CheckNotRefused(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(client);
  if (it == leases_.end() || it->second.refused.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this cluster refuses client ", client, ": ", it->second.refused,
                   "; what it held is collected (a new client may connect)"));
}

int64_t ClientLeases::Live(absl::Time now) {
  absl::MutexLock lock(&mu_);
  int64_t live = 0;
  for (const auto& [client, lease] : leases_) {
    if (lease.departed == absl::InfiniteFuture() && now - lease.last_seen <= timeout_) ++live;
  }
  return live;
}

std::vector<std::string> ClientLeases::TakeDeparted(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> departed;
  for (auto it = leases_.begin(); it != leases_.end();) {
    Lease& lease = it->second;
    if (lease.departed == absl::InfiniteFuture() && now - lease.last_seen > timeout_) lease.departed = now;
    const absl::Duration keep = lease.refused.empty() ? remember_ : refuse_for_;
    if (lease.departed != absl::InfiniteFuture() && now - lease.departed > keep) {
      leases_.erase(it++);
      continue;
    }
    if (lease.departed != absl::InfiniteFuture() && !lease.taken) {
      lease.taken = true;
      departed.push_back(it->first);
    }
    ++it;
  }
  return departed;
}

}  // namespace pathways
