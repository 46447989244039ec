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

void ClientLeases::DepartLocked(Lease& lease, absl::Time now, std::string why) {
  if (lease.departed != absl::InfiniteFuture()) return;
  lease.departed = now;
  lease.why_departed = std::move(why);
}

void ClientLeases::Goodbye(const std::string& client, absl::Time now) {
  absl::MutexLock lock(&mu_);
  DepartLocked(leases_[client], now, "it said goodbye");
}

void ClientLeases::Refuse(const std::string& client, std::string reason, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Lease& lease = leases_[client];
  DepartLocked(lease, now, "it was refused");
  lease.refused = reason;
  // Known however long ago the client went (its lease may be forgotten by the time a host reports
  // a computation that never ended).
  auto of = tenant_of_.find(client);
  if (of == tenant_of_.end()) return;
  // Shown to every tenant by `status`: the client by its label only.
  RefuseTenantLocked({of->second, absl::StrCat("its client ", ClientLabel(client), " was refused: ", reason),
                      now + refuse_for_},
                     now);
}

void ClientLeases::AdoptRefusal(TenantRefusal refusal, absl::Time now) {
  refusal.until = std::min(refusal.until, now + refuse_for_);
  absl::MutexLock lock(&mu_);
  RefuseTenantLocked(std::move(refusal), now);
}

void ClientLeases::RefuseTenantLocked(TenantRefusal refusal, absl::Time now) {
  const std::string tenant = refusal.tenant;
  if (!refused_tenants_.Add(std::move(refusal), now)) return;  // not a tenant's name, or already ended
  // Every client of the tenant departs with it: what they hold is collected.
  for (const auto& [other, its_tenant] : tenant_of_) {
    if (its_tenant != tenant) continue;
    auto l = leases_.find(other);
    if (l != leases_.end()) DepartLocked(l->second, now, absl::StrCat("its tenant ", tenant, " was refused"));
  }
}

absl::Status ClientLeases::CheckTenantNotRefused(const std::string& tenant, absl::Time now) {
  return refused_tenants_.Check(tenant, now);
}

absl::Status ClientLeases::CheckNotRefused(const std::string& client, const std::string& tenant, absl::Time now) {
  absl::MutexLock lock(&mu_);  // with Refuse's lock held: a tenant is refused before or after this call
  PW_RETURN_IF_ERROR(refused_tenants_.Check(tenant, now));
  // Its tenant is known from its first call on (a client id is derived from its credential, so no
  // other tenant's client can take it).
  if (!tenant.empty() && tenant_of_.try_emplace(client, tenant).second) {
    tenant_order_.emplace_back(now, client);
    ForgetTenantsLocked(now);
  }
  auto it = leases_.find(client);
  if (it == leases_.end()) return absl::OkStatus();
  const Lease& lease = it->second;
  if (!lease.refused.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("this cluster refuses client ", client, ": ", lease.refused,
                                                      "; what it held is collected (a new client may connect)"));
  }
  if (lease.departed == absl::InfiniteFuture()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "client ", client, " went away ", absl::ToInt64Seconds(now - lease.departed), " s ago (", lease.why_departed,
      "), and what it held (slices, arrays, programs) is collected: connect "
      "again as a new client"));
}

void ClientLeases::ForgetTenantsLocked(absl::Time now) {
  while (!tenant_order_.empty() &&
         (tenant_order_.size() > kMaxTenantsRemembered || now - tenant_order_.front().first > kRememberTenants)) {
    tenant_of_.erase(tenant_order_.front().second);
    tenant_order_.pop_front();
  }
}

std::string ClientLeases::TenantOf(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = tenant_of_.find(client);
  return it == tenant_of_.end() ? "" : it->second;
}

std::vector<TenantRefusal> ClientLeases::TenantRefusals(absl::Time now) { return refused_tenants_.InForce(now); }

int64_t ClientLeases::Live(absl::Time now) {
  absl::MutexLock lock(&mu_);
  int64_t live = 0;
  for (const auto& [client, lease] : leases_) {
    if (lease.departed == absl::InfiniteFuture() && now - lease.last_seen <= timeout_) ++live;
  }
  return live;
}

void ClientLeases::Awake(absl::Time now) {
  absl::MutexLock lock(&mu_);
  const absl::Duration away = stall_.Awake(now);
  if (away == absl::ZeroDuration()) return;
  for (auto& [client, lease] : leases_) {
    if (lease.departed == absl::InfiniteFuture()) lease.last_seen = StallCredit::Credited(lease.last_seen, now, away);
  }
}

std::vector<std::string> ClientLeases::TakeDeparted(absl::Time now) {
  absl::MutexLock lock(&mu_);
  ForgetTenantsLocked(now);
  std::vector<std::string> departed;
  size_t remembered = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    Lease& lease = it->second;
    if (lease.departed == absl::InfiniteFuture() && now - lease.last_seen > timeout_) {
      DepartLocked(lease, now,
                   absl::StrCat("its lease lapsed: no heartbeat for ", absl::FormatDuration(timeout_),
                                "; was its process paused or cut off?"));
    }
    const absl::Duration keep = lease.refused.empty() ? remember_ : refuse_for_;
    if (lease.departed != absl::InfiniteFuture() && now - lease.departed > keep) {
      leases_.erase(it++);
      continue;
    }
    if (lease.departed != absl::InfiniteFuture() && !lease.taken) {
      lease.taken = true;
      departed.push_back(it->first);
    }
    if (lease.departed != absl::InfiniteFuture() && lease.refused.empty()) ++remembered;
    ++it;
  }
  // Past kMaxRemembered departed clients (a flood of short-lived ones), the longest gone are
  // forgotten early, refused ones aside: every call of this scans every lease.
  if (remembered > kMaxRemembered) {
    std::vector<std::pair<absl::Time, std::string>> gone;
    for (const auto& [client, lease] : leases_) {
      if (lease.departed != absl::InfiniteFuture() && lease.refused.empty()) gone.emplace_back(lease.departed, client);
    }
    const size_t forget = gone.size() - kMaxRemembered;
    std::nth_element(gone.begin(), gone.begin() + static_cast<std::ptrdiff_t>(forget - 1), gone.end());
    for (size_t i = 0; i < forget; ++i) leases_.erase(gone[i].second);
  }
  return departed;
}

}  // namespace pathways
