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

Future<FetchedShards> WorkerClient::Fetch(const rpc::FetchRequest& request, uint64_t max_bytes) {
  FetchStreamClient* s = stream();
  std::optional<Future<FetchedShards>> streamed;
  if (s != nullptr) streamed = s->Fetch(request, max_bytes);
  if (!streamed.has_value()) return FetchThroughGrpc(request);  // no stream, or every one is busy
  // A stream that cannot be dialed belongs to an earlier worker process at this address (the
  // worker restarted with another stream port): ask again, and fetch through gRPC meanwhile.
  Promise<FetchedShards> promise;
  Future<FetchedShards> result = promise.future();
  streamed->OnReady([this, s, request, promise = std::move(promise)](
                        const absl::StatusOr<FetchedShards>& r) mutable {
    if (r.ok() || !FetchStreamClient::NotSent(r.status())) {
      promise.Set(r);
      return;
    }
    {
      absl::MutexLock lock(&stream_mu_);
      if (stream_.get() == s) {
        s->Stop();
        retired_.push_back(std::move(stream_));
        stream_state_ = StreamState::kUnknown;
      }
    }
    FetchThroughGrpc(request).OnReady([promise = std::move(promise)](const absl::StatusOr<FetchedShards>& g) mutable {
      promise.Set(g);
    });
  });
  return result;
}

FetchStreamClient* WorkerClient::stream() {
  {
    absl::MutexLock lock(&stream_mu_);
    if (stream_state_ != StreamState::kUnknown) return stream_.get();
    if (TlsConfigured()) {
      stream_state_ = StreamState::kKnown;  // and none: the stream is not encrypted
      return nullptr;
    }
    stream_state_ = StreamState::kAsking;
  }
  // Asked once, without waiting: fetches go through gRPC until the answer comes. A worker that
  // cannot answer (or offers no stream) is not asked again.
  AsyncUnaryCall<rpc::PingResponse>(
      absl::StrCat("Ping on worker ", address_), rpc::PingRequest(), absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Ping(ctx, req, resp, std::move(done)); })
      .OnReady([this](const absl::StatusOr<rpc::PingResponse>& r) {
        absl::MutexLock lock(&stream_mu_);
        stream_state_ = r.ok() || !absl::IsUnavailable(r.status()) ? StreamState::kKnown : StreamState::kUnknown;
        if (r.ok() && r->fetch_port() > 0 && r->fetch_port() <= 65535) {
          stream_ = std::make_unique<FetchStreamClient>(address_, address_.substr(0, address_.rfind(':')),
                                                        r->fetch_port());
        }
      });
  return nullptr;
}

Future<FetchedShards> WorkerClient::FetchThroughGrpc(const rpc::FetchRequest& request) {
  return AsyncUnaryCallShared<rpc::FetchResponse>(
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
