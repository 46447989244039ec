#include "transport/auth.h"

#include <algorithm>
#include <cstdlib>

#include <fstream>
#include <sstream>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/synchronization/mutex.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/stream_listener.h"
#include "openssl/crypto.h"
#include "openssl/rand.h"
#include "openssl/sha.h"

namespace pathways {
namespace {

constexpr char kTokenKey[] = "pathways-token";

// Never destroyed, as what it guards: threads still take it while the process exits.
absl::Mutex& token_mu = *new absl::Mutex;
bool token_set ABSL_GUARDED_BY(token_mu) = false;
std::string* token ABSL_GUARDED_BY(token_mu) = new std::string;  // never destroyed: used until exit

std::string EnvToken() {
  const char* env = std::getenv("PATHWAYS_TOKEN");
  return env == nullptr ? "" : env;
}

// Compares in constant time, so timing does not tell how much matched.
bool SameSecret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

void SetCallToken(std::string value) {
  absl::MutexLock lock(&token_mu);
  *token = std::move(value);
  token_set = true;
}

std::string CallToken() {
  absl::MutexLock lock(&token_mu);
  if (!token_set) {
    *token = EnvToken();
    token_set = true;
  }
  return *token;
}

std::string TokenOr(const std::optional<std::string>& own) { return own.has_value() ? *own : CallToken(); }

void AttachToken(grpc::ClientContext& context, const std::optional<std::string>& own) {
  const std::string value = TokenOr(own);
  if (!value.empty()) context.AddMetadata(kTokenKey, value);
}

void AttachCallToken(grpc::ClientContext& context) { AttachToken(context, std::nullopt); }

absl::Status CheckTokenCanTravel(const std::string& token, const std::string& what) {
  if (token.size() > kMaxStreamTokenBytes ||
      !std::all_of(token.begin(), token.end(), [](char c) { return c >= 0x20 && c <= 0x7e; })) {
    return absl::InvalidArgumentError(absl::StrCat("the token from ", what, " (", token.size(),
                                                   " bytes) is not printable ASCII of at most ", kMaxStreamTokenBytes,
                                                   " bytes"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> TokenFromFlagOrEnv(const std::string& flag) {
  std::string token = flag.empty() ? EnvToken() : flag;
  PW_RETURN_IF_ERROR(CheckTokenCanTravel(token, flag.empty() ? "PATHWAYS_TOKEN" : "--token"));
  return token;
}

absl::StatusOr<std::string> ClusterTokenFromFlagOrEnv(const std::string& flag, const std::string& token) {
  if (!flag.empty()) {
    PW_RETURN_IF_ERROR(CheckTokenCanTravel(flag, "--cluster-token"));
    return flag;
  }
  const char* env = std::getenv("PATHWAYS_CLUSTER_TOKEN");
  if (env == nullptr || *env == '\0') return token;
  PW_RETURN_IF_ERROR(CheckTokenCanTravel(env, "PATHWAYS_CLUSTER_TOKEN"));
  return std::string(env);
}

absl::StatusOr<std::string> TokenTenant(std::string_view sent, const TenantTokens& expected, const std::string& also) {
  if (!also.empty() && !sent.empty() && SameSecret(std::string(sent), also)) return std::string();
  return expected.TenantOf(sent);
}

absl::StatusOr<std::string> CallTenant(const grpc::ServerContextBase& context, const TenantTokens& expected,
                                       const std::string& also) {
  if (expected.open()) return std::string();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kTokenKey);
  const std::string_view sent = it == metadata.end() ? std::string_view()
                                                     : std::string_view(it->second.data(), it->second.size());
  return TokenTenant(sent, expected, also);
}

absl::Status CheckCallToken(const grpc::ServerContextBase& context, const TenantTokens& expected,
                            const std::string& also) {
  return CallTenant(context, expected, also).status();
}

absl::Status CheckToken(std::string_view sent, const TenantTokens& expected, const std::string& also) {
  return TokenTenant(sent, expected, also).status();
}

ClientIdentity NewClientIdentity() {
  unsigned char secret[32];
  if (RAND_bytes(secret, sizeof(secret)) != 1) {
    // OpenSSL reads the kernel's random source; a failure there leaves nothing safe to fall back to.
    PW_LOG(Error) << "cannot read random bytes for a client credential";
    std::abort();
  }
  ClientIdentity identity;
  identity.credential = absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(secret), sizeof(secret)));
  identity.id = ClientIdOf(identity.credential);
  return identity;
}

std::string ClientIdOf(const std::string& credential) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(credential.data()), credential.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), 16));
}

absl::Status CheckClientCredential(const std::string& client_id, const std::string& credential) {
  if (client_id.empty()) return absl::InvalidArgumentError("the request names no client");
  if (credential.empty()) {
    return absl::UnauthenticatedError(absl::StrCat("the request for client ", client_id, " carries no credential"));
  }
  if (!SameSecret(ClientIdOf(credential), client_id)) {
    return absl::UnauthenticatedError(absl::StrCat("the credential sent is not client ", client_id, "'s"));
  }
  return absl::OkStatus();
}

namespace {

struct TlsPems {
  std::string cert, key, ca;
};
absl::Mutex& tls_mu = *new absl::Mutex;  // never destroyed, as token_mu
TlsPems* tls ABSL_GUARDED_BY(tls_mu) = nullptr;  // never destroyed once set

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read the TLS ", what, " file '", path, "'"));
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string FlagOrEnv(const std::string& flag, const char* env) {
  if (!flag.empty()) return flag;
  const char* value = std::getenv(env);
  return value == nullptr ? "" : value;
}

}  // namespace

absl::Status ConfigureTls(const TlsFiles& files) {
  const std::string cert = FlagOrEnv(files.cert, "PATHWAYS_TLS_CERT");
  const std::string key = FlagOrEnv(files.key, "PATHWAYS_TLS_KEY");
  const std::string ca = FlagOrEnv(files.ca, "PATHWAYS_TLS_CA");
  if (cert.empty() && key.empty() && ca.empty()) return absl::OkStatus();
  if (cert.empty() != key.empty()) return absl::InvalidArgumentError("TLS needs both a certificate and its key");
  auto pems = std::make_unique<TlsPems>();
  if (!cert.empty()) {
    auto c = ReadPem(cert, "certificate");
    if (!c.ok()) return c.status();
    auto k = ReadPem(key, "key");
    if (!k.ok()) return k.status();
    pems->cert = *std::move(c);
    pems->key = *std::move(k);
  }
  if (!ca.empty()) {
    auto a = ReadPem(ca, "CA");
    if (!a.ok()) return a.status();
    pems->ca = *std::move(a);
  }
  absl::MutexLock lock(&tls_mu);
  tls = pems.release();
  return absl::OkStatus();
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() {
  absl::MutexLock lock(&tls_mu);
  if (tls == nullptr) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls->ca;
  return grpc::SslCredentials(options);
}

bool TlsConfigured() {
  absl::MutexLock lock(&tls_mu);
  return tls != nullptr;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials() {
  absl::MutexLock lock(&tls_mu);
  if (tls == nullptr || tls->cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({tls->key, tls->cert});
  return grpc::SslServerCredentials(options);
}

}  // namespace pathways
