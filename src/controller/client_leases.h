// Which clients are still there: each holds a lease it renews by heartbeating.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pathways {

// A client that says goodbye, or lets its lease lapse (its process died), has departed; the
// controller retires it (through every island's scheduler, so that hosts collect what it owned
// at one point of the island's order). A departed client is remembered for `remember`, so that
// a late heartbeat does not bring it back, then forgotten. Thread-safe; time is passed in, so
// expiry is testable without waiting.
class ClientLeases {
 public:
  ClientLeases(absl::Duration timeout, absl::Duration remember = absl::Seconds(60),
               absl::Duration refuse_for = absl::Hours(1))
      : timeout_(timeout), remember_(remember), refuse_for_(refuse_for) {}
  absl::Duration timeout() const { return timeout_; }

  void Renew(const std::string& client, absl::Time now);
  // A client a host says it holds: a lease from `now` unless the client is known already (its
  // lease stands) or departed (it stays so).
  void Adopt(const std::string& client, absl::Time now);
  void Goodbye(const std::string& client, absl::Time now);
  // A client whose computation held a device past its host's computation timeout, so that the
  // host left (a body that never ends): departed at once, as by a goodbye, and every later call
  // it makes is refused with `reason` for `refuse_for`, so that this client cannot take down the
  // next host the same way (a new client of the same tenant can: refusing a tenant would need
  // tokens per tenant).
  void Refuse(const std::string& client, std::string reason, absl::Time now);
  // OK, or FailedPrecondition with the reason the client was refused.
  absl::Status CheckNotRefused(const std::string& client);
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
  };
  const absl::Duration timeout_;
  const absl::Duration remember_;
  const absl::Duration refuse_for_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
