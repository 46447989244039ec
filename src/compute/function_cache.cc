#include "compute/function_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {

FunctionCache::FunctionCache(Compiler compiler, int64_t limit, int64_t account_limit)
    : compiler_(std::move(compiler)), limit_(limit), account_limit_(account_limit) {}

namespace {

const std::string& AccountOf(const FunctionCache::Owner& owner) {
  return owner.account.empty() ? owner.client : owner.account;
}

// Whether a client of `account` is among `owners` (client -> account).
bool Charged(const absl::flat_hash_map<std::string, std::string>& owners, const std::string& account) {
  return std::any_of(owners.begin(), owners.end(), [&](const auto& owner) { return owner.second == account; });
}

}  // namespace

absl::Status FunctionCache::CheckOwnerLocked(const Entry& entry, const Owner& owner, const FunctionBody& body) const {
  if (owner.client.empty() || entry.owners.contains(owner.client)) return absl::OkStatus();
  const std::string& account = AccountOf(owner);
  if (Charged(entry.owners, account)) return absl::OkStatus();
  auto it = accounts_.find(account);
  const int64_t kept = it == accounts_.end() ? 0 : it->second;
  if (kept + entry.held <= account_limit_) return absl::OkStatus();
  const bool tenant = account != owner.client;
  return absl::ResourceExhaustedError(absl::StrCat(
      "function '", body.DisplayName(), "' keeps ", entry.held, " bytes once compiled, and the functions ",
      tenant ? absl::StrCat("tenant '", account, "''s clients keep") : "this client keeps",
      " compiled on this worker hold ", kept, " of the ", account_limit_, " each ", tenant ? "named tenant" : "client",
      " may keep (worker flag --compiled-memory-per-client; they go when the client does)"));
}

void FunctionCache::AddOwnerLocked(Entry& entry, const Owner& owner) {
  if (owner.client.empty()) {
    entry.pinned = true;
    return;
  }
  const std::string& account = AccountOf(owner);
  if (entry.held > 0 && !entry.owners.contains(owner.client) && !Charged(entry.owners, account)) {
    accounts_[account] += entry.held;
  }
  if (entry.owners.emplace(owner.client, account).second) ++clients_[owner.client];
}

absl::StatusOr<std::shared_ptr<const Executable>> FunctionCache::Compile(const FunctionBody& body, const Owner& owner) {
  const std::string key = FunctionKey(body);
  {
    absl::MutexLock lock(&mu_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      PW_RETURN_IF_ERROR(CheckOwnerLocked(it->second, owner, body));
      AddOwnerLocked(it->second, owner);
      return it->second.executable;
    }
  }
  // Compiled outside the lock: TorchScript compilation takes milliseconds. Two racing compiles
  // of one body both succeed and the first stored wins.
  absl::StatusOr<std::shared_ptr<const Executable>> compiled = compiler_(body);
  if (!compiled.ok()) return compiled.status();
  Entry made{.executable = *std::move(compiled)};
  made.held = made.executable->held_bytes();
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  Entry& entry = it != cache_.end() ? it->second : made;
  // The account's allowance first: a refusal then names what the caller can change.
  PW_RETURN_IF_ERROR(CheckOwnerLocked(entry, owner, body));
  if (it == cache_.end()) {
    if (held_ + made.held > limit_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "function '", body.DisplayName(), "' keeps ", made.held, " bytes once compiled, and the ", cache_.size(),
          " functions compiled on this worker keep ", held_, " of the ", limit_,
          " it keeps for them (worker flag --compiled-memory; a function goes when the clients that compiled it do)"));
    }
    held_ += made.held;
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
      if (entry.held > 0 && !Charged(entry.owners, account)) {
        auto charge = accounts_.find(account);
        if ((charge->second -= entry.held) == 0) accounts_.erase(charge);
      }
      if (entry.owners.empty() && !entry.pinned) {
        held_ -= entry.held;
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
  for (const auto& [client, count] : clients_) clients.push_back(client);
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

int64_t FunctionCache::account_bytes(const std::string& account) const {
  absl::MutexLock lock(&mu_);
  auto it = accounts_.find(account);
  return it == accounts_.end() ? 0 : it->second;
}

}  // namespace pathways
