#include "transport/auth.h"

#include <cstdlib>

#include "absl/synchronization/mutex.h"

namespace pathways {
namespace {

constexpr char kTokenKey[] = "pathways-token";

absl::Mutex token_mu;
bool token_set ABSL_GUARDED_BY(token_mu) = false;
std::string* token ABSL_GUARDED_BY(token_mu) = new std::string;  // never destroyed: used until exit

std::string EnvToken() {
  const char* env = std::getenv("PATHWAYS_TOKEN");
  return env == nullptr ? "" : env;
}

// Compares without stopping at the first difference, so timing does not tell how much matched.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

void SetCallToken(std::string value) {
  absl::MutexLock lock(&token_mu);
  *token = std::move(value);
  token_set = true;
}

void AttachCallToken(grpc::ClientContext& context) {
  std::string value;
  {
    absl::MutexLock lock(&token_mu);
    if (!token_set) {
      *token = EnvToken();
      token_set = true;
    }
    value = *token;
  }
  if (!value.empty()) context.AddMetadata(kTokenKey, value);
}

std::string TokenFromFlagOrEnv(const std::string& flag) { return flag.empty() ? EnvToken() : flag; }

absl::Status CheckCallToken(const grpc::ServerContextBase& context, const std::string& expected) {
  if (expected.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kTokenKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("this cluster requires a token (--token or PATHWAYS_TOKEN); none was sent");
  }
  if (!SameSecret(std::string(it->second.data(), it->second.size()), expected)) {
    return absl::UnauthenticatedError("the token sent is not this cluster's");
  }
  return absl::OkStatus();
}

}  // namespace pathways
