// Which clients are still there: each holds a lease it renews by heartbeating.
#pragma once

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "controller/stall_credit.h"
#include "transport/tenant_tokens.h"

namespace pathways {

// A client that says goodbye, or lets its lease lapse (its process died, or was paused past the
// lease), has departed; the controller retires it (through every island's scheduler, so that
// hosts collect what it owned at one point of the island's order). A departed client is
// remembered for `remember`, so that a late heartbeat does not bring it back and its calls are
// told why they fail, then forgotten. Thread-safe; time is passed in, so expiry is testable
// without waiting.
class ClientLeases {
 public:
  ClientLeases(absl::Duration timeout, absl::Duration remember = absl::Minutes(10),
               absl::Duration refuse_for = absl::Hours(1))
      : timeout_(timeout), remember_(remember), refuse_for_(refuse_for), stall_(timeout) {}
  // The controller's loop that takes departed clients woke at `now`, before it takes them. If it
  // was away past a quarter of the lease timeout (the controller frozen or starved), every lease
  // is credited with that time: a client is not judged by heartbeats the controller could not hear.
  void Awake(absl::Time now);
  absl::Duration timeout() const { return timeout_; }

  void Renew(const std::string& client, absl::Time now);
  // A client a host says it holds: a lease from `now` unless the client is known already (its
  // lease stands) or departed (it stays so).
  void Adopt(const std::string& client, absl::Time now);
  void Goodbye(const std::string& client, absl::Time now);
  // A client whose computation held a device past its host's computation timeout, so that the
  // host left (a body that never ends): departed at once, as by a goodbye, and every later call
  // it makes is refused with `reason` for `refuse_for`, so that this client cannot take down the
  // next host the same way. When it acts for a named tenant (transport/tenant_tokens.h), so is
  // that tenant, and every client of the tenant departs with it: the same program would come
  // back as a new client otherwise. (Clients of the shared token are no tenant's: refusing them
  // all would refuse everyone.)
  void Refuse(const std::string& client, std::string reason, absl::Time now);
  // OK, or FailedPrecondition with the reason the client, or the named `tenant` it acts for
  // ("" none), was refused, or saying that the client departed (when and why: a client resumed
  // after a pause longer than its lease learns that what it held is gone). Remembers the client's
  // tenant for Refuse.
  absl::Status CheckNotRefused(const std::string& client, const std::string& tenant = "",
                               absl::Time now = absl::Now());
  // OK, or FailedPrecondition with the reason the named `tenant` was refused ("" never is).
  absl::Status CheckTenantNotRefused(const std::string& tenant, absl::Time now);
  // The named tenant `client` acts for, as far as its calls said; "" none.
  std::string TenantOf(const std::string& client);
  // Each tenant refused at `now`, why and until when, by name.
  std::vector<TenantRefusal> TenantRefusals(absl::Time now);
  // A refusal a host names as it registers (it heard of it from this controller's last
  // incarnation): the tenant is refused as by Refuse, for what is left of it (at most
  // `refuse_for`), and its clients known here depart. Those not known here (their calls since the
  // restart name their tenant) are refused from their next call, and their leases lapse.
  void AdoptRefusal(TenantRefusal refusal, absl::Time now);
  // Clients that departed since the last call (each is returned once).
  std::vector<std::string> TakeDeparted(absl::Time now);
  // Clients whose lease holds at `now`.
  int64_t Live(absl::Time now);

 private:
  struct Lease {
    absl::Time last_seen;
    absl::Time departed = absl::InfiniteFuture();
    bool taken = false;
    std::string refused;  // why its calls are refused; empty: they are not
    std::string why_departed;  // set with `departed`
  };
  // Departs `lease` at `now` for `why`, unless it departed already.
  static void DepartLocked(Lease& lease, absl::Time now, std::string why);
  void ForgetTenantsLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refuses `refusal.tenant` and departs its clients known here.
  void RefuseTenantLocked(TenantRefusal refusal, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Departed clients remembered at most (those refused aside); the longest gone go first.
  static constexpr size_t kMaxRemembered = size_t{1} << 16;
  // Clients' tenants are remembered this long after their first call, and this many at most
  // (oldest forgotten first), well past any computation timeout a host reports after.
  static constexpr absl::Duration kRememberTenants = absl::Hours(24);
  static constexpr size_t kMaxTenantsRemembered = size_t{1} << 20;
  const absl::Duration timeout_;
  const absl::Duration remember_;
  const absl::Duration refuse_for_;
  absl::Mutex mu_;
  StallCredit stall_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  RefusedTenants refused_tenants_;  // its own lock, taken after mu_
  absl::flat_hash_map<std::string, std::string> tenant_of_ ABSL_GUARDED_BY(mu_);  // client: named tenant
  std::deque<std::pair<absl::Time, std::string>> tenant_order_ ABSL_GUARDED_BY(mu_);  // first call, client
};

}  // namespace pathways
