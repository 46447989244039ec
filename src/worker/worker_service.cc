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

// Runs `work` on `pool` and finishes the call with its status; a call cancelled while it waited
// (the server is shutting down, the client went) is answered without doing the work.
template <typename Work>
void HandOff(ThreadPool& pool, grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor, Work work) {
  pool.Schedule([context, reactor, work = std::move(work)]() mutable {
    reactor->Finish(context->IsCancelled() ? grpc::Status::CANCELLED : ToGrpc(work()));
  });
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
  absl::Status s;
  if (cluster_only) {
    s = CheckCallToken(*context, cluster_token_);
  } else {
    absl::StatusOr<std::string> tenant = CallTenant(*context, token_, cluster_token_);
    s = !tenant.ok() ? tenant.status() : refused_ != nullptr ? refused_->Check(*tenant, absl::Now()) : absl::OkStatus();
  }
  if (!s.ok()) {
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
                                              rpc::PingResponse* response) {
  return Serve(context, absl::OkStatus(), [&](HostRuntime&, grpc::ServerUnaryReactor* reactor) {
    response->set_data_port(data_port_.load());
    reactor->Finish(grpc::Status::OK);
  });
}

grpc::ServerUnaryReactor* WorkerService::Compile(grpc::CallbackServerContext* context,
                                                 const rpc::CompileRequest* request,
                                                 rpc::CompileResponse* response) {
  return Serve(context, ClientOf(*request), [&](HostRuntime& rt, grpc::ServerUnaryReactor* reactor) {
    // A named tenant's clients share one allowance for what their functions keep; each client of
    // the shared token has its own (FunctionCache).
    FunctionCache::Owner owner{request->client_id(), CallTenant(*context, token_, cluster_token_).value_or("")};
    HandOff(compile_, context, reactor, [&rt, request, response, owner = std::move(owner)] {
      auto key = rt.Compile(request->body(), owner);
      if (key.ok()) response->set_function_key(*key);
      return key.status();
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
    HandOff(intake_, context, reactor, [&rt, request] { return rt.Enqueue(*request); });
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
