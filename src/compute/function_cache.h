// The compiled functions a worker keeps, whose they are, and how much of the host they may hold.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "compute/executable.h"
#include "compute/function_body.h"

namespace pathways {

// Compiles bodies once per content hash and keeps the results for the clients that asked for
// them. What each keeps (Executable::held_bytes, and the entry itself) is bounded twice: all
// together by `limit`, and what is kept for one account by `account_limit`. An account is a
// named tenant, whose clients share it, or else a client of the shared token. Past either bound a
// compile fails ResourceExhausted and what is cached stays. A function goes once every client it
// was compiled for is released (runs that hold it finish). So a named tenant cannot fill the cache
// alone, and whatever clients fill it give it back when they go; clients of the shared token make
// their own identities, so many of them together can fill it while they live. Thread-safe.
class FunctionCache {
 public:
  static constexpr int64_t kDefaultLimit = int64_t{2} << 30;
  static constexpr int64_t kDefaultAccountLimit = int64_t{512} << 20;
  // What an entry is charged besides what its executable keeps and its key and name: the
  // executable's own objects, the maps' nodes. A function that keeps nothing else (a built-in
  // kernel) is charged this, so none escapes the bounds.
  static constexpr int64_t kEntryBytes = 1024;

  // Whom a compile is for. An empty client is the host's own (tests, tools): kept for the cache's
  // life and charged to no account. `tenant`: the named tenant whose clients share one allowance;
  // empty for a client of the shared token, which has its own.
  struct Owner {
    std::string client;
    std::string tenant;
  };

  explicit FunctionCache(
      Compiler compiler = [](const FunctionBody& body) { return CompileForCpu(body); }, int64_t limit = kDefaultLimit,
      int64_t account_limit = kDefaultAccountLimit);

  // Compiles `body` unless a body with the same key is cached, and keeps it for `owner`. Errors
  // name the function, and for TorchScript include the compiler's message with the offending line.
  // An owner whose account, or a cache that, has no room left is refused before compiling.
  absl::StatusOr<std::shared_ptr<const Executable>> Compile(const FunctionBody& body, const Owner& owner = {});
  // nullptr when nothing with that key is kept here.
  std::shared_ptr<const Executable> Lookup(const std::string& key) const;
  // `client` keeps nothing from now on: the functions kept for it alone are dropped. Returns how
  // many. Idempotent.
  int Release(const std::string& client);
  // The clients functions are kept for.
  std::vector<std::string> Clients() const;

  size_t size() const;
  int64_t held_bytes() const;
  // What the functions kept for `owner`'s account are charged (each once, however many of its
  // clients share it).
  int64_t account_bytes(const Owner& owner) const;

 private:
  struct Entry {
    std::shared_ptr<const Executable> executable;
    int64_t charge = 0;                                    // held_bytes, and the entry itself
    bool pinned = false;                                   // the host's own
    absl::flat_hash_map<std::string, std::string> owners;  // client -> account
  };
  // Why `owner` may not keep a function charged `charge` more (its account's allowance), or OK.
  // `compiled`: the charge is the whole function's, not only its entry's.
  absl::Status CheckAccountLocked(const Owner& owner, int64_t charge, bool compiled, const FunctionBody& body) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `owner` may not keep `entry`, or OK.
  absl::Status CheckOwnerLocked(const Entry& entry, const Owner& owner, const FunctionBody& body) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why the cache may not keep a function charged `charge` more, or OK.
  absl::Status CheckTotalLocked(int64_t charge, bool compiled, const FunctionBody& body) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps `entry` for `owner`, charging its account unless another of the account's clients has it.
  void AddOwnerLocked(Entry& entry, const Owner& owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Compiler compiler_;
  const int64_t limit_;
  const int64_t account_limit_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> accounts_ ABSL_GUARDED_BY(mu_);  // charged to each
  absl::flat_hash_set<std::string> clients_ ABSL_GUARDED_BY(mu_);            // those any function is kept for
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
