// One asynchronous unary gRPC call as a Future.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "core/future.h"
#include "grpcpp/client_context.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

// Starts `start(context, request, response, done)` (a stub's async() method) and returns the
// response as a future, or the call's error prefixed with `description`. The future completes
// on gRPC's callback thread: continuations that do real work should hop to an executor.
template <typename Response, typename Request, typename Start>
Future<Response> AsyncUnaryCall(std::string description, const Request& request, absl::Duration timeout,
                                Start start) {
  struct CallState {
    grpc::ClientContext context;
    Request request;
    Response response;
    Promise<Response> promise;
  };
  auto* call = new CallState;
  call->request = request;
  AttachCallToken(call->context);
  if (timeout != absl::InfiniteDuration()) {
    call->context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
  }
  Future<Response> result = call->promise.future();
  start(&call->context, &call->request, &call->response,
        [call, description = std::move(description)](grpc::Status status) {
          std::unique_ptr<CallState> owned(call);
          if (status.ok()) {
            owned->promise.Set(std::move(owned->response));
          } else {
            owned->promise.Set(FromGrpc(status, description));
          }
        });
  return result;
}

}  // namespace pathways
