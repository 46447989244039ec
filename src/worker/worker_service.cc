#include "worker/worker_service.h"

#include "transport/rpc_util.h"

namespace pathways {
namespace {
const grpc::Status kNotReady(grpc::StatusCode::UNAVAILABLE, "worker is starting");
}  // namespace

HostRuntime* WorkerService::runtime() { return runtime_.load(); }

grpc::ServerUnaryReactor* WorkerService::Compile(grpc::CallbackServerContext* context,
                                                 const rpc::CompileRequest* request,
                                                 rpc::CompileResponse* response) {
  auto* reactor = context->DefaultReactor();
  HostRuntime* rt = runtime();
  if (rt == nullptr) {
    reactor->Finish(kNotReady);
    return reactor;
  }
  auto key = rt->Compile(request->body());
  if (key.ok()) response->set_function_key(*key);
  reactor->Finish(ToGrpc(key.status()));
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Enqueue(grpc::CallbackServerContext* context,
                                                 const rpc::EnqueueRequest* request,
                                                 rpc::EnqueueResponse*) {
  auto* reactor = context->DefaultReactor();
  HostRuntime* rt = runtime();
  if (rt == nullptr) {
    reactor->Finish(kNotReady);
    return reactor;
  }
  reactor->Finish(ToGrpc(rt->Enqueue(*request)));
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::GetTrace(grpc::CallbackServerContext* context,
                                                  const rpc::GetTraceRequest* request,
                                                  rpc::GetTraceResponse* response) {
  auto* reactor = context->DefaultReactor();
  HostRuntime* rt = runtime();
  if (rt == nullptr) {
    reactor->Finish(kNotReady);
    return reactor;
  }
  *response = rt->GetTrace(*request);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::Fetch(grpc::CallbackServerContext* context,
                                               const rpc::FetchRequest* request,
                                               rpc::FetchResponse* response) {
  auto* reactor = context->DefaultReactor();
  HostRuntime* rt = runtime();
  if (rt == nullptr) {
    reactor->Finish(kNotReady);
    return reactor;
  }
  rt->Fetch(*request).OnReady(
      [reactor, response](const absl::StatusOr<rpc::FetchResponse>& r) {
        if (r.ok()) *response = *r;
        reactor->Finish(ToGrpc(r.status()));
      });
  return reactor;
}

}  // namespace pathways
