#include "transport/worker_client.h"

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/async_call.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

constexpr int kMaxMessageBytes = 1 << 30;

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args = ChannelArgs();
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address, ChannelCredentials(), args);
}

}  // namespace

WorkerClient::WorkerClient(std::string address)
    : address_(std::move(address)),
      channel_(MakeChannel(address_)),
      stub_(rpc::Worker::NewStub(channel_)) {}

Future<rpc::CompileResponse> WorkerClient::Compile(const rpc::CompileRequest& request) {
  return AsyncUnaryCall<rpc::CompileResponse>(
      absl::StrCat("Compile on worker ", address_), request, absl::Seconds(120),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Compile(ctx, req, resp, std::move(done)); });
}

Future<rpc::JoinControlGraphResponse> WorkerClient::JoinControlGraph(const rpc::ControlGraph& request) {
  return AsyncUnaryCall<rpc::JoinControlGraphResponse>(
      absl::StrCat("JoinControlGraph on worker ", address_), request, absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->JoinControlGraph(ctx, req, resp, std::move(done)); });
}

Future<rpc::EnqueueResponse> WorkerClient::Enqueue(const rpc::EnqueueRequest& request) {
  return AsyncUnaryCall<rpc::EnqueueResponse>(
      absl::StrCat("Enqueue on worker ", address_), request, absl::Seconds(60),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Enqueue(ctx, req, resp, std::move(done)); });
}

Future<rpc::FetchResponse> WorkerClient::Fetch(const rpc::FetchRequest& request) {
  return AsyncUnaryCall<rpc::FetchResponse>(
      absl::StrCat("Fetch on worker ", address_), request, absl::InfiniteDuration(),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Fetch(ctx, req, resp, std::move(done)); });
}

WorkerClientCache& WorkerClientCache::Global() {
  static auto* cache = new WorkerClientCache;  // never destroyed; see the class comment
  return *cache;
}

Future<rpc::GetTraceResponse> WorkerClient::GetTrace(const rpc::GetTraceRequest& request) {
  return AsyncUnaryCall<rpc::GetTraceResponse>(
      absl::StrCat("GetTrace on worker ", address_), request, absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->GetTrace(ctx, req, resp, std::move(done)); });
}

bool WorkerClient::WaitUntilConnected(absl::Time deadline) {
  return channel_->WaitForConnected(absl::ToChronoTime(deadline));
}

std::shared_ptr<WorkerClient> WorkerClientCache::Get(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& slot = clients_[address];
  if (!slot) slot = std::make_shared<WorkerClient>(address);
  return slot;
}

HostOpQueue::HostOpQueue(std::shared_ptr<WorkerClient> worker, ClientIdentity client)
    : worker_(std::move(worker)), session_(static_cast<int64_t>(absl::Uniform<uint64_t>(absl::BitGen()) >> 1)) {
  queue_ = std::make_shared<OrderedBatchQueue<rpc::Op>>(
      [worker = worker_, client = std::move(client)](std::vector<rpc::Op> ops) {
        rpc::EnqueueRequest request;
        request.set_client_id(client.id);
        request.set_credential(client.credential);
        for (rpc::Op& op : ops) *request.add_ops() = std::move(op);
        return worker->Enqueue(request).Then([](const rpc::EnqueueResponse&) { return Unit{}; });
      });
}

int64_t HostOpQueue::Push(rpc::Op op) {
  absl::MutexLock lock(&mu_);
  op.set_seq(++seq_);
  op.set_session(session_);
  queue_->Push(std::move(op));
  return seq_;
}

int64_t HostOpQueue::ReserveSeq() {
  absl::MutexLock lock(&mu_);
  return ++seq_;
}

void HostOpQueue::SkipReserved(int64_t seq) {
  rpc::Op op;
  op.mutable_skip();
  op.set_seq(seq);
  op.set_session(session_);
  queue_->Push(std::move(op));
}

int64_t HostOpQueue::last_seq() {
  absl::MutexLock lock(&mu_);
  return seq_;
}

}  // namespace pathways
