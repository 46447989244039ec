#include "transport/tenant_tokens.h"

#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"
#include "openssl/crypto.h"
#include "transport/auth.h"

namespace pathways {

namespace {

constexpr size_t kMinTenantTokenBytes = 16;

bool SameSecret(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

bool GoodName(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') return false;
  }
  return true;
}

}  // namespace

TenantTokens::TenantTokens(std::string token) : token_(std::move(token)) {}

absl::StatusOr<TenantTokens> TenantTokens::Parse(std::string token, std::string_view text, std::string_view source,
                                                 const std::string& cluster_token) {
  auto named = std::make_shared<std::vector<std::pair<std::string, std::string>>>();
  absl::flat_hash_set<std::string> names, tokens;
  int line_number = 0;
  // Debian's Abseil has its own string_view.
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
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
          absl::StrCat(where, ": tenant name '", name.substr(0, 80), "' is not 1-64 of letters, digits, '_', '.', '-'"));
    }
    PW_RETURN_IF_ERROR(CheckTokenCanTravel(secret, absl::StrCat(where, " (tenant ", name, ")")));
    if (secret.size() < kMinTenantTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tenant ", name, "'s token has ", secret.size(),
                                                     " characters; at least ", kMinTenantTokenBytes,
                                                     " (e.g. `openssl rand -hex 16`)"));
    }
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tenant ", name, " is named twice"));
    }
    if (!tokens.insert(secret).second || SameSecret(secret, token)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tenant ", name, "'s token is another tenant's (or the shared --token)"));
    }
    if (!cluster_token.empty() && SameSecret(secret, cluster_token)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tenant ", name, "'s token is the cluster token, which would let it pose as a host"));
    }
    named->emplace_back(secret, name);
  }
  TenantTokens tenants(std::move(token));
  tenants.named_ = std::move(named);
  return tenants;
}

absl::StatusOr<TenantTokens> TenantTokens::Load(std::string token, const std::string& path,
                                                const std::string& cluster_token) {
  if (path.empty()) return TenantTokens(std::move(token));
  if (cluster_token.empty()) {
    return absl::InvalidArgumentError(
        "--tenants needs a cluster token (--cluster-token, PATHWAYS_CLUSTER_TOKEN or --token): without one any "
        "process could act as a host");
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the tenants file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return Parse(std::move(token), text.str(), path, cluster_token);
}

absl::StatusOr<std::string> TenantTokens::TenantOf(std::string_view sent) const {
  if (open()) return std::string();
  if (sent.empty()) {
    return absl::UnauthenticatedError("this cluster requires a token (--token or PATHWAYS_TOKEN); none was sent");
  }
  if (!token_.empty() && SameSecret(sent, token_)) return std::string();
  if (named_ != nullptr) {
    for (const auto& [secret, name] : *named_) {
      if (SameSecret(sent, secret)) return name;
    }
  }
  return absl::UnauthenticatedError("the token sent is not this cluster's");
}

}  // namespace pathways
