// Access control between clients, workers and the controller: a shared secret token on every
// call, and TLS on every connection when given a certificate and key.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "transport/tenant_tokens.h"

namespace pathways {

// The token outgoing calls of this process carry unless their connection was given its own (a
// client connected with ClientOptions::token): set by SetCallToken, else read once from the
// environment variable PATHWAYS_TOKEN. Empty: no token is sent.
void SetCallToken(std::string token);
void AttachCallToken(grpc::ClientContext& context);
// That token, for connections that are not gRPC calls (data streams).
std::string CallToken();
// A connection's own token when it has one, else the process's (CallToken, read at each call).
std::string TokenOr(const std::optional<std::string>& own);
void AttachToken(grpc::ClientContext& context, const std::optional<std::string>& own);

// OK when `token` can travel: gRPC takes only printable ASCII in a metadata value (it aborts the
// process on another), and stream hellos carry at most kMaxStreamTokenBytes. InvalidArgument
// naming `what` (where the token came from) otherwise, never the token itself.
absl::Status CheckTokenCanTravel(const std::string& token, const std::string& what);

// `flag` when given, else PATHWAYS_TOKEN, else none: the token a server requires, or a command
// line tool sends. InvalidArgument when it cannot travel (CheckTokenCanTravel).
absl::StatusOr<std::string> TokenFromFlagOrEnv(const std::string& flag);

// Two tokens guard a cluster. Tenants (clients, `pathways status`) show the token; workers and
// the controller show the cluster token to each other, and the calls only they make (registering,
// heartbeats, rendezvous, control graphs, dataflow streams, links between hosts) require it. So
// the token lets a process in as a tenant, never as a host or a controller. Returns `flag` when
// given, else PATHWAYS_CLUSTER_TOKEN, else `token` (one secret for both roles). InvalidArgument when
// it cannot travel.
absl::StatusOr<std::string> ClusterTokenFromFlagOrEnv(const std::string& flag, const std::string& token);

// The tenant a call makes (TenantTokens::TenantOf its token), or "" when it carries `also` (the
// cluster token, when not empty: hosts act for no tenant). Unauthenticated otherwise (never says
// what the token should be). `expected` may be one token (a string).
absl::StatusOr<std::string> CallTenant(const grpc::ServerContextBase& context, const TenantTokens& expected,
                                       const std::string& also = "");
// The same of a token `sent` some other way (streams); compares in constant time.
absl::StatusOr<std::string> TokenTenant(std::string_view sent, const TenantTokens& expected,
                                        const std::string& also = "");
// Whether the call (or `sent`) is admitted at all, as one of those tenants or as a host.
absl::Status CheckCallToken(const grpc::ServerContextBase& context, const TenantTokens& expected,
                            const std::string& also = "");
absl::Status CheckToken(std::string_view sent, const TenantTokens& expected, const std::string& also = "");

// A client's identity. Its id is public: logs, the island schedulers and every host see it. Its
// credential is a random secret that only the client holds, and the id is derived from it (the
// first 128 bits of its SHA-256, in hex), so any server can check a call against the id it names
// without asking anyone: no table of credentials to hand out to hosts, nothing for a restarted
// controller to lose, and knowing an id (from `status`, a log) gives no way to act as its client.
// Calls that act for a client (schedule, heartbeat and goodbye, slices, ops, fetches, traces)
// carry both; servers refuse the call when they do not match.
struct ClientIdentity {
  std::string id;
  std::string credential;
};
// A new identity from the operating system's random source (OpenSSL's RAND_bytes).
ClientIdentity NewClientIdentity();
// The id that `credential` belongs to.
std::string ClientIdOf(const std::string& credential);
// OK when `credential` is the one `client_id` was derived from; Unauthenticated otherwise (naming
// the client, never the credential). An empty id is InvalidArgument.
absl::Status CheckClientCredential(const std::string& client_id, const std::string& credential);

// TLS for every channel and server of this process (one process talks to one cluster). PEM file
// paths; an empty path falls back to PATHWAYS_TLS_CERT, PATHWAYS_TLS_KEY, PATHWAYS_TLS_CA. A
// process that serves (controller, worker) needs cert and key; one that only calls (client,
// status) needs the CA that signed the servers' certificates. Nothing set: plaintext.
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
};
// Reads the files; InvalidArgument naming one that cannot be read.
absl::Status ConfigureTls(const TlsFiles& files);
// What channels and servers are built with: TLS once configured, plaintext otherwise.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials();
std::shared_ptr<grpc::ServerCredentials> ServerCredentials();
// Whether TLS is configured (ConfigureTls with any file): connections that gRPC does not carry,
// and that would carry secrets or tenants' data in the clear, are not used then.
bool TlsConfigured();

}  // namespace pathways
