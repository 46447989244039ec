#include "transport/tenant_tokens.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "openssl/crypto.h"
#include "openssl/sha.h"
#include "proto/pathways.pb.h"
#include "transport/auth.h"

namespace pathways {

namespace {

constexpr size_t kMinTenantTokenBytes = 16;

bool SameSecret(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// SHA-256: what tokens are compared by.
std::string Digest(std::string_view token) {
  unsigned char out[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), out);
  return std::string(reinterpret_cast<const char*>(out), sizeof(out));
}

bool GoodName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') return false;
  }
  return true;
}

}  // namespace

TenantTokens::TenantTokens(std::string token)
    : token_(std::move(token)), token_digest_(token_.empty() ? std::string() : Digest(token_)) {}

absl::StatusOr<TenantTokens> TenantTokens::Parse(std::string token, std::string_view text, std::string_view source,
                                                 const std::string& cluster_token) {
  auto named = std::make_shared<std::vector<Named>>();
  absl::flat_hash_map<std::string, int> names, tokens;  // the line each came on
  int line_number = 0;
  // Errors name the line and the field, never what the fields hold: a line whose fields are the
  // wrong way round would print its token.
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_number;
    // A comment starts with a '#' at the start of a field: a token may hold one.
    for (size_t at = line.find('#'); at != absl::string_view::npos; at = line.find('#', at + 1)) {
      if (at == 0 || std::isspace(static_cast<unsigned char>(line[at - 1]))) {
        line = line.substr(0, at);
        break;
      }
    }
    std::vector<absl::string_view> fields = absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    const std::string where = absl::StrCat(std::string(source), ":", line_number);
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": a tenant is a line 'NAME TOKEN', this one has ",
                                                     fields.size(), " fields"));
    }
    const std::string name(fields[0]), secret(fields[1]);
    if (!GoodName(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the name (first field) is not 1-64 of letters, digits, '_', '.', '-'"));
    }
    PW_RETURN_IF_ERROR(CheckTokenCanTravel(secret, absl::StrCat(where, " (second field)")));
    if (secret.size() < kMinTenantTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token (second field) has ", secret.size(),
                                                     " characters; at least ", kMinTenantTokenBytes,
                                                     " (e.g. `openssl rand -hex 16`)"));
    }
    if (auto [it, inserted] = names.try_emplace(name, line_number); !inserted) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the name was given on line ", it->second));
    }
    if (auto [it, inserted] = tokens.try_emplace(secret, line_number); !inserted) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token is line ", it->second, "'s too"));
    }
    if (SameSecret(secret, token)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the token is the shared --token"));
    }
    if (!cluster_token.empty() && SameSecret(secret, cluster_token)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the token is the cluster token, which would let the tenant pose as a host"));
    }
    named->push_back(Named{Digest(secret), name});
  }
  TenantTokens tenants(std::move(token));
  tenants.named_ = std::move(named);
  return tenants;
}

absl::StatusOr<TenantTokens> TenantTokens::Load(std::string token, const std::string& path,
                                                const std::string& cluster_token) {
  if (path.empty()) return TenantTokens(std::move(token));
  if (cluster_token.empty() || SameSecret(cluster_token, token)) {
    return absl::InvalidArgumentError(
        "--tenants needs a cluster token of its own (--cluster-token or PATHWAYS_CLUSTER_TOKEN, not the shared "
        "--token): otherwise any holder of the shared token (or anyone, without one) could act as a host and "
        "reach the tenants' data");
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the tenants file ", path, ": ", std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  return Parse(std::move(token), text.str(), path, cluster_token);
}

absl::StatusOr<std::string> TenantTokens::TenantOf(std::string_view sent) const {
  if (open()) return std::string();
  if (sent.empty()) {
    return absl::UnauthenticatedError("this cluster requires a token (--token or PATHWAYS_TOKEN); none was sent");
  }
  // Every entry is compared, whole digests of equal size, so how long it takes says nothing about
  // which token matched or how long one is.
  const std::string digest = Digest(sent);
  const bool shared = !token_.empty() && CRYPTO_memcmp(digest.data(), token_digest_.data(), digest.size()) == 0;
  const std::string* named = nullptr;
  if (named_ != nullptr) {
    for (const Named& n : *named_) {
      if (CRYPTO_memcmp(digest.data(), n.digest.data(), digest.size()) == 0) named = &n.name;
    }
  }
  if (named != nullptr) return *named;
  if (shared) return std::string();
  return absl::UnauthenticatedError("the token sent is not this cluster's");
}

rpc::TenantRefusal ToProto(const TenantRefusal& refusal, absl::Time now) {
  rpc::TenantRefusal proto;
  proto.set_tenant(refusal.tenant);
  proto.set_reason(refusal.reason);
  proto.set_remaining_ms(std::max<int64_t>(0, absl::ToInt64Milliseconds(refusal.until - now)));
  return proto;
}

TenantRefusal FromProto(const rpc::TenantRefusal& refusal, absl::Time now) {
  return {refusal.tenant(), refusal.reason(), now + absl::Milliseconds(std::max<int64_t>(0, refusal.remaining_ms()))};
}

void RefusedTenants::Set(std::vector<TenantRefusal> refusals, absl::Time now) {
  absl::MutexLock lock(&mu_);
  refusals_.clear();
  for (TenantRefusal& r : refusals) {
    if (Bound(r, now)) refusals_[r.tenant] = std::move(r);
  }
  TrimLocked(now);
}

bool RefusedTenants::Add(TenantRefusal refusal, absl::Time now) {
  if (!Bound(refusal, now)) return false;
  absl::MutexLock lock(&mu_);
  auto [it, added] = refusals_.try_emplace(refusal.tenant, refusal);
  if (!added && it->second.until < refusal.until) it->second = std::move(refusal);
  TrimLocked(now);
  return true;
}

bool RefusedTenants::Bound(TenantRefusal& refusal, absl::Time now) {
  if (!GoodName(refusal.tenant) || refusal.until < now) return false;
  if (refusal.reason.size() > kMaxReasonBytes) refusal.reason.resize(kMaxReasonBytes);
  return true;
}

void RefusedTenants::TrimLocked(absl::Time now) {
  if (refusals_.size() <= kMax) return;
  absl::erase_if(refusals_, [now](const auto& entry) { return entry.second.until < now; });
  while (refusals_.size() > kMax) {
    auto soonest = std::min_element(refusals_.begin(), refusals_.end(), [](const auto& a, const auto& b) {
      return a.second.until < b.second.until;
    });
    refusals_.erase(soonest);
  }
}

absl::Status RefusedTenants::Check(const std::string& tenant, absl::Time now) const {
  if (tenant.empty()) return absl::OkStatus();
  TenantRefusal refusal;
  {
    absl::MutexLock lock(&mu_);
    auto it = refusals_.find(tenant);
    if (it == refusals_.end() || it->second.until < now) return absl::OkStatus();
    refusal = it->second;
  }
  return absl::FailedPreconditionError(absl::StrCat("this cluster refuses tenant ", tenant, " until ",
                                                    absl::FormatTime(refusal.until), ": ", refusal.reason,
                                                    "; what its clients held is collected"));
}

std::vector<TenantRefusal> RefusedTenants::InForce(absl::Time now) const {
  std::vector<TenantRefusal> in_force;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tenant, r] : refusals_) {
      if (r.until >= now) in_force.push_back(r);
    }
  }
  std::sort(in_force.begin(), in_force.end(),
            [](const TenantRefusal& a, const TenantRefusal& b) { return a.tenant < b.tenant; });
  return in_force;
}

}  // namespace pathways
