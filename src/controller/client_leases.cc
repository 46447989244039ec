#include "controller/client_leases.h"

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
    if (lease.departed != absl::InfiniteFuture() && now - lease.departed > remember_) {
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
