// The gRPC face of a HostRuntime. Handlers never block and never do long work on gRPC's threads
// (which serve every call of this worker): long waits (Fetch) finish from continuations, and
// compilation, large puts and program registrations are handed to an executor of their own.
#pragma once

#include <atomic>

#include "core/executor.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/tenant_tokens.h"
#include "worker/host_runtime.h"

namespace pathways {

class WorkerService final : public rpc::Worker::CallbackService {
 public:
  // The runtime is attached once the server's port, and so the host's name, is known; calls
  // that arrive before then are refused with Unavailable.
  void AttachRuntime(HostRuntime* runtime) { runtime_.store(runtime); }
  // The port of the worker's data stream, told to clients that ping (0: none).
  void SetDataPort(int port) { data_port_.store(port); }
  // Tenants' calls must carry a token of `tenants`, the controller's `cluster_token` (see
  // transport/auth.h); open or empty: none needed. Set before serving.
  // Calls of the `refused` tenants are refused (not owned; outlives this service).
  void RequireTokens(TenantTokens tenants, std::string cluster_token, const RefusedTenants* refused) {
    refused_ = refused;
    token_ = std::move(tenants);
    cluster_token_ = std::move(cluster_token);
  }

  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context, const rpc::PingRequest* request,
                                 rpc::PingResponse* response) override;
  grpc::ServerUnaryReactor* Compile(grpc::CallbackServerContext* context,
                                    const rpc::CompileRequest* request,
                                    rpc::CompileResponse* response) override;
  grpc::ServerUnaryReactor* JoinControlGraph(grpc::CallbackServerContext* context, const rpc::ControlGraph* request,
                                             rpc::JoinControlGraphResponse* response) override;
  grpc::ServerUnaryReactor* Enqueue(grpc::CallbackServerContext* context,
                                    const rpc::EnqueueRequest* request,
                                    rpc::EnqueueResponse* response) override;
  grpc::ServerUnaryReactor* GetTrace(grpc::CallbackServerContext* context,
                                     const rpc::GetTraceRequest* request,
                                     rpc::GetTraceResponse* response) override;
  grpc::ServerUnaryReactor* Fetch(grpc::CallbackServerContext* context,
                                  const rpc::FetchRequest* request,
                                  rpc::FetchResponse* response) override;

 private:
  template <typename Handler>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, absl::Status client, Handler handle,
                                  bool cluster_only = false);
  std::atomic<HostRuntime*> runtime_{nullptr};  // not owned; outlives this service
  std::atomic<int> data_port_{0};
  // Long work, each on a thread of its own so that one kind does not wait behind the other:
  // TorchScript compilation, and ops with large puts or program registrations (the sequencer
  // applies ops in their clients' order whichever thread adds them). A call cancelled while it
  // waited (the server is shutting down, the client went) is answered without doing the work.
  ThreadPool compile_{"worker-compile", 1};
  ThreadPool intake_{"worker-intake", 1};
  TenantTokens token_;
  std::string cluster_token_;
  const RefusedTenants* refused_ = nullptr;
};

}  // namespace pathways
