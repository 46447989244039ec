// Who may call a cluster as a tenant, and as which tenant.
//
// A cluster admits tenants by token: the shared token (`--token`, PATHWAYS_TOKEN) and, with
// `--tenants FILE`, one token per named tenant (a line `NAME TOKEN` each; `#` starts a comment).
// A call's token says which tenant makes it, so the controller can refuse one tenant (say, one
// whose function took a host down) without refusing the others; clients of the shared token are
// the unnamed tenant "". Hosts show the cluster token instead (transport/auth.h), which is never a
// tenant's.
//
// Immutable once made, so copies share one table and are safe to use from any thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pathways {

class TenantTokens {
 public:
  // Admits every call, as the unnamed tenant: a cluster without tokens.
  TenantTokens() = default;
  // Only the shared `token` (empty: every call). Implicit: where one token was asked for, the
  // tenants' tokens may be given.
  TenantTokens(std::string token);  // NOLINT(google-explicit-constructor)
  TenantTokens(const char* token) : TenantTokens(std::string(token)) {}  // NOLINT

  // The shared `token` (may be empty) and the named tenants of `text`, read from `source` (named
  // in errors). `#` at the start of a field starts a comment. InvalidArgument, naming the line
  // and the field (never what it holds), for a malformed line, a name that is not 1-64 of
  // [A-Za-z0-9_.-], a token shorter than 16 characters or one that cannot travel
  // (CheckTokenCanTravel), a name or token given twice, or a token equal to the shared one or to
  // `cluster_token` (a tenant could pose as a host).
  static absl::StatusOr<TenantTokens> Parse(std::string token, std::string_view text, std::string_view source,
                                            const std::string& cluster_token);
  // The same, from the file at `path` (none when empty); NotFound when it cannot be read,
  // InvalidArgument when there is a file but no `cluster_token`, or the shared `token` is it
  // (hosts would be unguarded from tenants).
  static absl::StatusOr<TenantTokens> Load(std::string token, const std::string& path,
                                           const std::string& cluster_token);

  // No token is asked for: every call is admitted, as the unnamed tenant.
  bool open() const { return token_.empty() && (named_ == nullptr || named_->empty()); }
  // Named tenants there are.
  size_t named() const { return named_ == nullptr ? 0 : named_->size(); }

  // The tenant whose token `sent` is: "" for the shared token (or when the cluster is open), the
  // tenant's name for a named one. Unauthenticated otherwise, never saying what the token
  // should be. Compares in constant time.
  absl::StatusOr<std::string> TenantOf(std::string_view sent) const;

 private:
  struct Named {
    std::string digest;  // SHA-256 of the token
    std::string name;
  };
  std::string token_;
  std::string token_digest_;
  std::shared_ptr<const std::vector<Named>> named_;
};

namespace rpc {
class TenantRefusal;
}

// A named tenant the cluster refuses until a time, and why.
struct TenantRefusal {
  std::string tenant;
  std::string reason;
  absl::Time until;
};

// On the wire a refusal carries how long it has left (hosts' clocks need not agree); `now` is the
// sender's, then the receiver's.
rpc::TenantRefusal ToProto(const TenantRefusal& refusal, absl::Time now);
TenantRefusal FromProto(const rpc::TenantRefusal& refusal, absl::Time now);

// The named tenants a cluster refuses, each until its time: the controller's record, and a
// worker's copy of it (from the controller's heartbeat answers), which the worker hands to a
// controller that restarted when it registers again, so that a refusal outlives the restart.
// Thread-safe.
class RefusedTenants {
 public:
  // At most this many are kept (past it, refusals that end soonest make room), each reason cut
  // at kMaxReasonBytes: every heartbeat answer carries them all, within gRPC's 4 MiB.
  static constexpr size_t kMax = 512;
  static constexpr size_t kMaxReasonBytes = 2048;

  // Replaces every refusal. Refusals of names no tenant can have (TenantTokens::Parse's rule),
  // or ended at `now`, are left out, here and in Add.
  void Set(std::vector<TenantRefusal> refusals, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Adds `refusal`; one of the same tenant in force already ends at the later of the two times.
  // False when it is left out.
  bool Add(TenantRefusal refusal, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // OK, or FailedPrecondition naming `tenant`, until when and why ("" is never refused).
  absl::Status Check(const std::string& tenant, absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);
  // The refusals in force at `now`, by tenant name.
  std::vector<TenantRefusal> InForce(absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // False for a refusal to leave out; cuts its reason.
  static bool Bound(TenantRefusal& refusal, absl::Time now);
  void TrimLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TenantRefusal> refusals_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
