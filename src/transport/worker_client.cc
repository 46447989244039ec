#include "transport/worker_client.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

constexpr int kMaxMessageBytes = 1 << 30;

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

WorkerClient::WorkerClient(std::string address)
    : address_(std::move(address)),
      channel_(MakeChannel(address_)),
      stub_(rpc::Worker::NewStub(channel_)) {}

template <typename Request, typename Response, typename Method>
Future<Response> WorkerClient::Call(const char* what, const Request& request, Method method,
                                    absl::Duration timeout) {
  struct CallState {
    grpc::ClientContext context;
    Request request;
    Response response;
    Promise<Response> promise;
  };
  auto* call = new CallState;
  call->request = request;
  if (timeout != absl::InfiniteDuration()) {
    call->context.set_deadline(std::chrono::system_clock::now() +
                               absl::ToChronoMilliseconds(timeout));
  }
  Future<Response> result = call->promise.future();
  std::string description = absl::StrCat(what, " on worker ", address_);
  method(stub_->async(), &call->context, &call->request, &call->response,
         [call, description](grpc::Status status) {
                              std::unique_ptr<CallState> owned(call);
                              if (status.ok()) {
                                owned->promise.Set(std::move(owned->response));
                              } else {
                                owned->promise.Set(FromGrpc(status, description));
                              }
                            });
  return result;
}

Future<rpc::CompileResponse> WorkerClient::Compile(const rpc::CompileRequest& request) {
  return Call<rpc::CompileRequest, rpc::CompileResponse>(
      "Compile", request, 
      [](auto* async, auto* ctx, auto* req, auto* resp, auto cb) {
        async->Compile(ctx, req, resp, std::move(cb));
      },
      absl::Seconds(120));
}

Future<rpc::EnqueueResponse> WorkerClient::Enqueue(const rpc::EnqueueRequest& request) {
  return Call<rpc::EnqueueRequest, rpc::EnqueueResponse>(
      "Enqueue", request, 
      [](auto* async, auto* ctx, auto* req, auto* resp, auto cb) {
        async->Enqueue(ctx, req, resp, std::move(cb));
      },
      absl::Seconds(60));
}

Future<rpc::FetchResponse> WorkerClient::Fetch(const rpc::FetchRequest& request) {
  return Call<rpc::FetchRequest, rpc::FetchResponse>(
      "Fetch", request, 
      [](auto* async, auto* ctx, auto* req, auto* resp, auto cb) {
        async->Fetch(ctx, req, resp, std::move(cb));
      },
      absl::InfiniteDuration());
}

WorkerClientCache& WorkerClientCache::Global() {
  static auto* cache = new WorkerClientCache;  // never destroyed; see the class comment
  return *cache;
}

Future<rpc::GetTraceResponse> WorkerClient::GetTrace(const rpc::GetTraceRequest& request) {
  return Call<rpc::GetTraceRequest, rpc::GetTraceResponse>(
      "GetTrace", request,
      [](auto* async, auto* ctx, auto* req, auto* resp, auto cb) {
        async->GetTrace(ctx, req, resp, std::move(cb));
      },
      absl::Seconds(30));
}

std::shared_ptr<WorkerClient> WorkerClientCache::Get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& slot = clients_[address];
  if (!slot) slot = std::make_shared<WorkerClient>(address);
  return slot;
}

HostOpQueue::HostOpQueue(std::shared_ptr<WorkerClient> worker, std::string client_id)
    : worker_(std::move(worker)), client_id_(std::move(client_id)) {}

void HostOpQueue::Push(rpc::Op op) {
  std::optional<rpc::EnqueueRequest> batch;
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return;  // Flushed() reports the failure
    pending_.push_back(std::move(op));
    ++pushed_;
    if (!in_flight_) batch = TakeBatchLocked();
  }
  if (batch) Send(*std::move(batch));
}

Future<Unit> HostOpQueue::Flushed() {
  absl::MutexLock lock(&mu_);
  if (!failure_.ok()) return Future<Unit>::Ready(failure_);
  if (acked_ == pushed_) return Future<Unit>::Ready(Unit{});
  Promise<Unit> p;
  Future<Unit> f = p.future();
  waiters_.emplace_back(pushed_, std::move(p));
  return f;
}

rpc::EnqueueRequest HostOpQueue::TakeBatchLocked() {
  rpc::EnqueueRequest request;
  request.set_client_id(client_id_);
  for (auto& op : pending_) *request.add_ops() = std::move(op);
  pending_.clear();
  in_flight_ = true;
  in_flight_end_ = pushed_;
  return request;
}

// Sent without mu_ held: the completion callback may run on any thread, even this one.
void HostOpQueue::Send(rpc::EnqueueRequest request) {
  worker_->Enqueue(request).OnReady(
      [self = shared_from_this()](const absl::StatusOr<rpc::EnqueueResponse>& r) {
        self->OnBatchDone(r.status());
      });
}

void HostOpQueue::OnBatchDone(absl::Status status) {
  std::vector<Promise<Unit>> ready;
  std::optional<rpc::EnqueueRequest> next;
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
    if (!status.ok()) {
      failure_ = status;
      pending_.clear();
    } else {
      acked_ = in_flight_end_;
    }
    failure = failure_;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (!failure_.ok() || it->first <= acked_) {
        ready.push_back(std::move(it->second));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
    if (failure_.ok() && !pending_.empty()) next = TakeBatchLocked();
  }
  if (next) Send(*std::move(next));
  for (auto& p : ready) {
    if (failure.ok()) {
      p.Set(Unit{});
    } else {
      p.Set(failure);
    }
  }
}

}  // namespace pathways
