// The gRPC face of a HostRuntime. Handlers never block: long waits (Fetch) finish from
// continuations.
#pragma once

#include <atomic>

#include "proto/pathways.grpc.pb.h"
#include "worker/host_runtime.h"

namespace pathways {

class WorkerService final : public rpc::Worker::CallbackService {
 public:
  // The runtime is attached once the server's port, and so the host's name, is known; calls
  // that arrive before then are refused with Unavailable.
  void AttachRuntime(HostRuntime* runtime) { runtime_.store(runtime); }
  // Calls must carry this token (see transport/auth.h); empty: none needed. Set before serving.
  void RequireToken(std::string token) { token_ = std::move(token); }

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
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, absl::Status client, Handler handle);
  std::atomic<HostRuntime*> runtime_{nullptr};  // not owned
  std::string token_;
};

}  // namespace pathways
