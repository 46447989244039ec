#include "controller/client_leases.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/ids.h"
#include "core/status_macros.h"

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
  lease.refused = reason;
  if (lease.tenant.empty()) return;
  const std::string tenant = lease.tenant;
  // Shown to every tenant by `status`: the client by its label only.
  refused_tenants_[tenant] =
      Refusal{absl::StrCat("its client ", ClientLabel(client), " was refused: ", reason), now + refuse_for_};
  for (auto& [other, l] : leases_) {
    if (l.tenant == tenant && l.departed == absl::InfiniteFuture()) l.departed = now;
  }
}

absl::Status ClientLeases::TenantRefusedLocked(const std::string& tenant, absl::Time now) {
  if (tenant.empty()) return absl::OkStatus();
  auto it = refused_tenants_.find(tenant);
  if (it == refused_tenants_.end()) return absl::OkStatus();
  if (now > it->second.until) {
    refused_tenants_.erase(it);
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("this cluster refuses tenant ", tenant, " until ", absl::FormatTime(it->second.until), ": ",
                   it->second.reason, "; what its clients held is collected"));
}

absl::Status ClientLeases::CheckTenantNotRefused(const std::string& tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  return TenantRefusedLocked(tenant, now);
}

absl::Status ClientLeases::CheckNotRefused(const std::string& client, const std::string& tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);
  PW_RETURN_IF_ERROR(TenantRefusedLocked(tenant, now));
  auto it = leases_.find(client);
  if (!tenant.empty()) {
    // Its tenant is known from its first call on (a client id is derived from its credential, so
    // no other tenant's client can take it), and the call is a sign of life, as a heartbeat.
    if (it == leases_.end()) {
      it = leases_.try_emplace(client).first;
      it->second.last_seen = now;
    }
    if (it->second.tenant.empty()) it->second.tenant = tenant;
  }
  if (it == leases_.end() || it->second.refused.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this cluster refuses client ", client, ": ", it->second.refused,
                   "; what it held is collected (a new client may connect)"));
}

std::string ClientLeases::TenantOf(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(client);
  return it == leases_.end() ? "" : it->second.tenant;
}

std::vector<std::string> ClientLeases::RefusedTenants(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> refused;
  for (const auto& [tenant, r] : refused_tenants_) {
    if (now <= r.until) refused.push_back(absl::StrCat(tenant, ": ", r.reason));
  }
  std::sort(refused.begin(), refused.end());
  return refused;
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
