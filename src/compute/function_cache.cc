#include "compute/function_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {

FunctionCache::FunctionCache(Compiler compiler, int64_t limit, int64_t account_limit)
    : compiler_(std::move(compiler)), limit_(limit), account_limit_(account_limit) {}

namespace {

// The key of `owner`'s account: its tenant's, or its own. Client ids and tenant names could
// coincide; these keys cannot.
std::string AccountOf(const FunctionCache::Owner& owner) {
  return owner.tenant.empty() ? "client " + owner.client : "tenant " + owner.tenant;
}

// Whether a client of `account` is among `owners` (client -> account).
bool Charged(const absl::flat_hash_map<std::string, std::string>& owners, const std::string& account) {
  return std::any_of(owners.begin(), owners.end(), [&](const auto& owner) { return owner.second == account; });
}

// What a function is charged, for refusals: all of it once compiled, the entry alone before.
std::string WhatItKeeps(const FunctionBody& body, int64_t charge, bool compiled) {
  return absl::StrCat("function '", body.DisplayName(), "' keeps ", compiled ? "" : "at least ", charge,
                      " bytes once compiled, and");
}

}  // namespace

absl::Status FunctionCache::CheckAccountLocked(const Owner& owner, int64_t charge, bool compiled,
                                               const FunctionBody& body) const {
  if (owner.client.empty()) return absl::OkStatus();
  auto it = accounts_.find(AccountOf(owner));
  const int64_t kept = it == accounts_.end() ? 0 : it->second;
  if (kept + charge <= account_limit_) return absl::OkStatus();
  const bool tenant = !owner.tenant.empty();
  return absl::ResourceExhaustedError(absl::StrCat(
      WhatItKeeps(body, charge, compiled), " the functions ",
      tenant ? absl::StrCat("tenant ", owner.tenant, "'s clients keep") : "this client keeps",
      " compiled on this worker hold ", kept, " of the ", account_limit_, " bytes each ",
      tenant ? "named tenant" : "client", " may keep (worker flag --compiled-memory-per-client; they go when ",
      tenant ? "its clients do)" : "the client does)"));
}

absl::Status FunctionCache::CheckOwnerLocked(const Entry& entry, const Owner& owner, const FunctionBody& body) const {
  if (owner.client.empty() || entry.owners.contains(owner.client) || Charged(entry.owners, AccountOf(owner))) {
    return absl::OkStatus();
  }
  return CheckAccountLocked(owner, entry.charge, /*compiled=*/true, body);
}

absl::Status FunctionCache::CheckTotalLocked(int64_t charge, bool compiled, const FunctionBody& body) const {
  if (held_ + charge <= limit_) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(WhatItKeeps(body, charge, compiled), " the ", cache_.size(),
                   " functions compiled on this worker keep ", held_, " of the ", limit_,
                   " bytes it keeps for them (worker flag --compiled-memory; a client's functions go when it does)"));
}

void FunctionCache::AddOwnerLocked(Entry& entry, const Owner& owner) {
  if (owner.client.empty()) {
    entry.pinned = true;
    return;
  }
  std::string account = AccountOf(owner);
  if (!entry.owners.contains(owner.client) && !Charged(entry.owners, account)) accounts_[account] += entry.charge;
  entry.owners.emplace(owner.client, std::move(account));
  clients_.insert(owner.client);
}

absl::StatusOr<std::shared_ptr<const Executable>> FunctionCache::Compile(const FunctionBody& body, const Owner& owner) {
  const std::string key = FunctionKey(body);
  const int64_t entry_bytes = kEntryBytes + static_cast<int64_t>(key.size() + body.name.size());
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      PW_RETURN_IF_ERROR(CheckOwnerLocked(it->second, owner, body));
      AddOwnerLocked(it->second, owner);
      return it->second.executable;
    }
    // No room for even the entry: refused before the compiler's time and memory are spent on it.
    PW_RETURN_IF_ERROR(CheckAccountLocked(owner, entry_bytes, /*compiled=*/false, body));
    PW_RETURN_IF_ERROR(CheckTotalLocked(entry_bytes, /*compiled=*/false, body));
  }
  // Compiled outside the lock: TorchScript compilation takes milliseconds. Two racing compiles
  // of one body both succeed and the first stored wins.
  absl::StatusOr<std::shared_ptr<const Executable>> compiled = compiler_(body);
  if (!compiled.ok()) return compiled.status();
  Entry made{.executable = *std::move(compiled)};
  made.charge = entry_bytes + std::max<int64_t>(made.executable->held_bytes(), 0);
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  // The account's allowance first: a refusal then names what the caller can change.
  PW_RETURN_IF_ERROR(CheckOwnerLocked(it != cache_.end() ? it->second : made, owner, body));
  if (it == cache_.end()) {
    PW_RETURN_IF_ERROR(CheckTotalLocked(made.charge, /*compiled=*/true, body));
    held_ += made.charge;
    it = cache_.emplace(key, std::move(made)).first;
  }
  AddOwnerLocked(it->second, owner);
  return it->second.executable;
}

std::shared_ptr<const Executable> FunctionCache::Lookup(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  return it == cache_.end() ? nullptr : it->second.executable;
}

int FunctionCache::Release(const std::string& client) {
  std::vector<std::shared_ptr<const Executable>> dropped;  // destroyed outside the lock
  {
    absl::MutexLock lock(&mu_);
    if (!clients_.erase(client)) return 0;
    for (auto it = cache_.begin(); it != cache_.end();) {
      Entry& entry = it->second;
      auto owned = entry.owners.find(client);
      if (owned == entry.owners.end()) {
        ++it;
        continue;
      }
      const std::string account = std::move(owned->second);
      entry.owners.erase(owned);
      if (!Charged(entry.owners, account)) {
        auto charged = accounts_.find(account);
        if ((charged->second -= entry.charge) == 0) accounts_.erase(charged);
      }
      if (entry.owners.empty() && !entry.pinned) {
        held_ -= entry.charge;
        dropped.push_back(std::move(entry.executable));
        cache_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  return static_cast<int>(dropped.size());
}

std::vector<std::string> FunctionCache::Clients() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> clients;
  clients.reserve(clients_.size());
  for (const std::string& client : clients_) clients.push_back(client);
  return clients;
}

size_t FunctionCache::size() const {
  absl::MutexLock lock(&mu_);
  return cache_.size();
}

int64_t FunctionCache::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_;
}

int64_t FunctionCache::account_bytes(const Owner& owner) const {
  absl::MutexLock lock(&mu_);
  auto it = accounts_.find(AccountOf(owner));
  return it == accounts_.end() ? 0 : it->second;
}

}  // namespace pathways
