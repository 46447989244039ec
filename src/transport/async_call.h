// One asynchronous unary gRPC call as a Future.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "core/future.h"
#include "core/tsan.h"
#include "grpcpp/client_context.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

// The call's state, and how its response becomes the future's value (`Wrap`).
template <typename Response, typename Value, typename Wrap, typename Request, typename Start>
Future<Value> StartUnaryCall(std::string description, const std::optional<std::string>& token, const Request& request,
                             absl::Duration timeout, Start start, Wrap wrap) {
  struct CallState {
    grpc::ClientContext context;
    Request request;
    Response response;
    grpc::Status status;
    std::string description;
    Wrap wrap;
    Promise<Value> promise;
  };
  auto* call = new CallState{{}, request, {}, {}, std::move(description), std::move(wrap), {}};
  AttachToken(call->context, token);
  if (timeout != absl::InfiniteDuration()) {
    call->context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  }
  Future<Value> result = call->promise.future();
  Executor* completions = &RpcCompletions();  // made here the first time, not on gRPC's thread
  TsanRelease(call);  // gRPC's core hands the call to the thread that completes it
  start(&call->context, &call->request, &call->response, [call, completions](grpc::Status status) {
    TsanAcquire(call);
    call->status = std::move(status);
    // gRPC's thread only hands over: the promise's continuations may do real work, or block.
    completions->Schedule([call] {
      std::unique_ptr<CallState> owned(call);
      if (owned->status.ok()) {
        owned->promise.Set(owned->wrap(std::move(owned->response)));
      } else {
        owned->promise.Set(FromGrpc(owned->status, owned->description));
      }
    });
  });
  return result;
}

// Starts `start(context, request, response, done)` (a stub's async() method) and returns the
// response as a future, or the call's error prefixed with `description`. The call carries
// `token` when given, else the process's (TokenOr). The future completes on a thread of
// RpcCompletions(), which inline continuations share with every other call's.
template <typename Response, typename Request, typename Start>
Future<Response> AsyncUnaryCall(std::string description, const std::optional<std::string>& token,
                                const Request& request, absl::Duration timeout, Start start) {
  return StartUnaryCall<Response, Response>(std::move(description), token, request, timeout, std::move(start),
                                            [](Response&& r) { return std::move(r); });
}

// The same, with the response held by a shared_ptr: for large responses, which continuations
// would otherwise copy.
template <typename Response, typename Request, typename Start>
Future<std::shared_ptr<Response>> AsyncUnaryCallShared(std::string description,
                                                       const std::optional<std::string>& token,
                                                       const Request& request, absl::Duration timeout, Start start) {
  return StartUnaryCall<Response, std::shared_ptr<Response>>(
      std::move(description), token, request, timeout, std::move(start),
      [](Response&& r) { return std::make_shared<Response>(std::move(r)); });
}

}  // namespace pathways
