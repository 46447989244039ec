// Conversions between runtime types and their wire form.
#pragma once

#include "absl/status/status.h"
#include "array/sharding.h"
#include "compute/function_body.h"
#include "core/executor.h"
#include "core/types.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"
#include "proto/pathways.pb.h"

namespace pathways {

// Settings every server of the runtime shares: one process per address (no SO_REUSEPORT, so a
// second server on a taken port fails to start instead of sharing it), keepalive pings allowed,
// and time limits on connections that never finish their handshake or sit idle.
void ConfigureServer(grpc::ServerBuilder& builder);
// Arguments for channels to the runtime's servers: keepalive pings while calls are in flight, so
// a call to a process that stopped (frozen, cut off) fails within KeepaliveMs() * 2 instead of
// waiting as long as its TCP connection looks open.
grpc::ChannelArguments ChannelArgs();
// 2000, or PATHWAYS_KEEPALIVE_MS (500 to 600000) when set: a machine that stands in for hundreds
// of hosts (simulated devices) starves processes for seconds at a time, which is not a failure
// there. Clients' data streams to workers bound a worker's silence by it too (worker_client.cc).
// Read once per process; a value out of range is refused with a warning.
int KeepaliveMs();
// Builds and starts `builder`'s server on `address` (added by the caller with its credentials,
// bound port in `*port`); a clear error naming `what` and the address when it cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(grpc::ServerBuilder& builder, const std::string& what,
                                                         const std::string& address, const int* port);

// Where the completions of the runtime's outgoing calls run: gRPC's callback threads only hand
// each one over to this pool, where the call's promise is settled and the continuations run.
// It grows while continuations block (one may wait for another call), up to 64 threads; one
// pool for the process, never shut down.
Executor& RpcCompletions();

grpc::Status ToGrpc(const absl::Status& status);
absl::Status FromGrpc(const grpc::Status& status);
// Prefixes a failed call's status with what was being done and with whom.
absl::Status FromGrpc(const grpc::Status& status, const std::string& what);

rpc::TensorSpecProto ToProto(const TensorSpec& spec);
// Validates the dtype and the shape (non-negative, bounded size).
absl::StatusOr<TensorSpec> FromProto(const rpc::TensorSpecProto& proto);

rpc::RegionProto ToProto(const Region& region);
Region FromProto(const rpc::RegionProto& proto);

rpc::FunctionBodyProto ToProto(const FunctionBody& body);
// Validates what the body says about itself (ValidateFunctionBody).
absl::StatusOr<FunctionBody> FromProto(const rpc::FunctionBodyProto& proto);

}  // namespace pathways
