// Shared-secret access control between clients, workers and the controller.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"

namespace pathways {

// The token every outgoing call of this process carries (one process talks to one cluster):
// set by SetCallToken, else read once from the environment variable PATHWAYS_TOKEN. Empty: no
// token is sent.
void SetCallToken(std::string token);
void AttachCallToken(grpc::ClientContext& context);

// `flag` when given, else PATHWAYS_TOKEN, else none: the token a server requires, or a command
// line tool sends.
std::string TokenFromFlagOrEnv(const std::string& flag);

// OK when `expected` is empty or the call carries it; Unauthenticated otherwise (never says
// what the token should be).
absl::Status CheckCallToken(const grpc::ServerContextBase& context, const std::string& expected);

}  // namespace pathways
