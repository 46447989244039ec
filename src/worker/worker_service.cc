#include "worker/worker_service.h"

#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// The check of the credential of the client a request acts for.
template <typename Request>
absl::Status ClientOf(const Request& request) {
  return CheckClientCredential(request.client_id(), request.credential());
}

// Whether applying the ops is long work for a gRPC thread: they put more than a few pages of data
// (copies into device memory) or register large programs (planning grows with nodes and
// shards). Small requests are applied where they arrive: a hop to another thread would cost
// more than the work, and the client's next run may already wait on the host for them.
bool IsLongWork(const rpc::EnqueueRequest& request) {
  constexpr size_t kShortBytes = 64 << 10;
  constexpr int kShortProgramNodes = 64;
  size_t bytes = 0;
  for (const rpc::Op& op : request.ops()) {
    if (op.has_put()) bytes += op.put().data().size();
    if (op.has_register_program()) {
      if (op.register_program().program().nodes_size() > kShortProgramNodes) return true;
      bytes += op.register_program().ByteSizeLong();
    }
  }
  return bytes > kShortBytes;
}

}  // namespace

// Runs `handle(runtime, reactor)` once the call is admitted and the runtime is attached. Admitted:
// it carries the token (the cluster token when `cluster_only`), and `client` is OK (the check of
// the credential of the client the call acts for; OK for calls that act for none).
template <typename Handler>
grpc::ServerUnaryReactor* WorkerService::Serve(grpc::CallbackServerContext* context, absl::Status client,
                                               Handler handle, bool cluster_only) {
  auto* reactor = context->DefaultReactor();
  HostRuntime* runtime = runtime_.load();
  if (absl::Status s = cluster_only ? CheckCallToken(*context, cluster_token_)
                                    : CheckCallToken(*context, token_, cluster_token_);
      !s.ok()) {
    reactor->Finish(ToGrpc(s));
  } else if (!client.ok()) {
    reactor->Finish(ToGrpc(client));
  } else if (runtime == nullptr) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is starting"));
  } else {
    handle(*runtime, reactor);
  }
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Ping(grpc::CallbackServerContext* context, const rpc::PingRequest*,
                                              rpc::PingResponse*) {
  return Serve(context, absl::OkStatus(),
               [&](HostRuntime&, grpc::ServerUnaryReactor* reactor) { reactor->Finish(grpc::Status::OK); });
}

grpc::ServerUnaryReactor* WorkerService::Compile(grpc::CallbackServerContext* context,
                                                 const rpc::CompileRequest* request,
                                                 rpc::CompileResponse* response) {
  return Serve(context, absl::OkStatus(), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    compile_.Schedule([&rt, context, request, response, reactor] {
      if (context->IsCancelled()) return reactor->Finish(grpc::Status::CANCELLED);
      auto key = rt.Compile(request->body());
      if (key.ok()) response->set_function_key(*key);
      reactor->Finish(ToGrpc(key.status()));
    });
  });
}

grpc::ServerUnaryReactor* WorkerService::Enqueue(grpc::CallbackServerContext* context,
                                                 const rpc::EnqueueRequest* request,
                                                 rpc::EnqueueResponse*) {
  return Serve(context, ClientOf(*request), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    if (!IsLongWork(*request)) {
      reactor->Finish(ToGrpc(rt.Enqueue(*request)));
      return;
    }
    intake_.Schedule([&rt, context, request, reactor] {
      if (context->IsCancelled()) return reactor->Finish(grpc::Status::CANCELLED);
      reactor->Finish(ToGrpc(rt.Enqueue(*request)));
    });
  });
}

grpc::ServerUnaryReactor* WorkerService::JoinControlGraph(grpc::CallbackServerContext* context,
                                                          const rpc::ControlGraph* request,
                                                          rpc::JoinControlGraphResponse*) {
  return Serve(context, absl::OkStatus(), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    reactor->Finish(ToGrpc(rt.JoinControlGraph(*request)));
  }, /*cluster_only=*/true);
}

grpc::ServerUnaryReactor* WorkerService::GetTrace(grpc::CallbackServerContext* context,
                                                  const rpc::GetTraceRequest* request,
                                                  rpc::GetTraceResponse* response) {
  return Serve(context, ClientOf(*request), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    *response = rt.GetTrace(*request);
    reactor->Finish(grpc::Status::OK);
  });
}

// Finishes from a continuation once the shards are computed; no handler thread waits.
grpc::ServerUnaryReactor* WorkerService::Fetch(grpc::CallbackServerContext* context,
                                               const rpc::FetchRequest* request,
                                               rpc::FetchResponse* response) {
  return Serve(context, ClientOf(*request), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    rt.Fetch(*request, response).OnReady([reactor](const absl::StatusOr<Unit>& r) {
      reactor->Finish(ToGrpc(r.status()));
    });
  });
}

}  // namespace pathways
