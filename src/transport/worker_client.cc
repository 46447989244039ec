#include "transport/worker_client.h"

#include <algorithm>
#include <thread>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "transport/async_call.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

constexpr int kMaxMessageBytes = 1 << 30;
// How long a fetch that failed Unavailable waits for the channel to connect before it is made again.
constexpr absl::Duration kReachableWait = absl::Seconds(3);

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args = ChannelArgs();
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address, ChannelCredentials(), args);
}

}  // namespace

WorkerClient::WorkerClient(std::string address, std::optional<std::string> token)
    : address_(std::move(address)),
      token_(std::move(token)),
      channel_(MakeChannel(address_)),
      stub_(rpc::Worker::NewStub(channel_)) {}

Future<rpc::CompileResponse> WorkerClient::Compile(const rpc::CompileRequest& request) {
  return AsyncUnaryCall<rpc::CompileResponse>(
      absl::StrCat("Compile on worker ", address_), token_, request, absl::Seconds(120),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Compile(ctx, req, resp, std::move(done)); });
}

Future<rpc::JoinControlGraphResponse> WorkerClient::JoinControlGraph(const rpc::ControlGraph& request) {
  return AsyncUnaryCall<rpc::JoinControlGraphResponse>(
      absl::StrCat("JoinControlGraph on worker ", address_), token_, request, absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->JoinControlGraph(ctx, req, resp, std::move(done)); });
}

namespace {

// How long a stream port that could not be dialed is left alone (fetches use gRPC meanwhile),
// and how long after a failed question the worker is asked again.
constexpr absl::Duration kUnreachablePause = absl::Seconds(30);
constexpr absl::Duration kAskAgain = absl::Seconds(10);

// A stream whose last reference may go on one of its own threads (a fetch's continuation) is
// destroyed on a thread of its own: its destructor joins its threads. It gives up on a silent
// worker after 5 s, or 2.5 keepalive periods where PATHWAYS_KEEPALIVE_MS makes that longer (gRPC's
// calls give up after about 2): processes starve for seconds where hundreds of simulated hosts
// share two cores. Never less: the worker says it is still waiting once a second.
std::shared_ptr<DataStreamClient> NewStream(const std::string& address, int port,
                                            const std::optional<std::string>& token) {
  DataStreamTiming timing;
  timing.silence = std::max(timing.silence, absl::Milliseconds(KeepaliveMs()) * 5 / 2);
  return std::shared_ptr<DataStreamClient>(
      new DataStreamClient(address, address.substr(0, address.rfind(':')), port, timing, token),
      [](DataStreamClient* s) {
        try {
          std::thread([s] { delete s; }).detach();
        } catch (const std::system_error&) {
          s->Stop();  // no thread to be had: its threads end, and the object is left behind
        }
      });
}

}  // namespace

template <typename T>
Future<T> WorkerClient::StreamElseGrpc(const std::shared_ptr<DataStreamClient>& s,
                                       std::optional<Future<T>> streamed, std::function<Future<T>()> grpc,
                                       std::shared_ptr<RequestPaths> paths) {
  auto count = [paths](bool over_stream) {
    if (paths != nullptr) (over_stream ? paths->streamed : paths->grpc).fetch_add(1, std::memory_order_relaxed);
  };
  if (!streamed.has_value()) {  // no stream, or every connection is busy
    count(false);
    return grpc();
  }
  // One the worker never served goes through gRPC. A stream that cannot be dialed may belong to
  // an earlier worker process at this address (one that restarted has another port): the worker
  // is asked again, and the stream rests meanwhile.
  Promise<T> promise;
  Future<T> result = promise.future();
  streamed->OnReady([this, s, grpc = std::move(grpc), count, promise = std::move(promise)](
                        const absl::StatusOr<T>& r) mutable {
    if (r.ok() || DataStreamClient::WhyNotSent(r.status()) == DataStreamClient::NotSentReason::kSent) {
      count(true);
      promise.Set(r);
      return;
    }
    count(false);
    NoteStreamFailure(s, r.status());
    grpc().OnReady([promise = std::move(promise)](const absl::StatusOr<T>& g) mutable { promise.Set(g); });
  });
  return result;
}

Future<FetchedShards> WorkerClient::Fetch(const rpc::FetchRequest& request, uint64_t max_bytes,
                                          std::shared_ptr<RequestPaths> paths) {
  std::shared_ptr<DataStreamClient> s = stream();
  std::optional<Future<FetchedShards>> streamed;
  if (s != nullptr) streamed = s->Fetch(request, max_bytes);
  return StreamElseGrpc<FetchedShards>(
      s, std::move(streamed), [this, request] { return FetchThroughGrpc(request); }, std::move(paths));
}

Future<Unit> WorkerClient::Enqueue(std::shared_ptr<const rpc::EnqueueRequest> request,
                                   std::shared_ptr<RequestPaths> paths) {
  // The data stream first: a gRPC call costs the worker about as much CPU again as the ops it
  // carries when they are a free or two (measured with collective_bench's CPU table). Requests
  // over the stream's bound (puts of data too small to stage) go through gRPC.
  std::shared_ptr<DataStreamClient> s = stream();
  std::optional<Future<Unit>> streamed;
  if (s != nullptr) streamed = s->Enqueue(*request);
  return StreamElseGrpc<Unit>(
      s, std::move(streamed), [this, request] { return EnqueueThroughGrpc(*request); }, std::move(paths));
}

Future<Unit> WorkerClient::EnqueueThroughGrpc(const rpc::EnqueueRequest& request) {
  return AsyncUnaryCall<rpc::EnqueueResponse>(
             absl::StrCat("Enqueue on worker ", address_), token_, request, kEnqueueAnswerBound,
             [this](auto* ctx, auto* req, auto* resp, auto done) {
               stub_->async()->Enqueue(ctx, req, resp, std::move(done));
             })
      .Then([](const rpc::EnqueueResponse&) { return Unit{}; });
}

Future<Unit> WorkerClient::Stage(const rpc::StageRequest& request, std::shared_ptr<const std::string> bytes) {
  std::shared_ptr<DataStreamClient> s = stream();
  std::optional<Future<Unit>> staged;
  if (s != nullptr) staged = s->Stage(request, std::move(bytes));
  if (!staged.has_value()) {
    return Future<Unit>::Ready(absl::UnavailableError(absl::StrCat("no data stream to worker ", address_, " free")));
  }
  Promise<Unit> promise;
  Future<Unit> result = promise.future();
  staged->OnReady([this, s, promise = std::move(promise)](const absl::StatusOr<Unit>& r) mutable {
    if (!r.ok()) NoteStreamFailure(s, r.status());
    promise.Set(r);
  });
  return result;
}

void WorkerClient::NoteStreamFailure(const std::shared_ptr<DataStreamClient>& s, const absl::Status& status) {
  if (DataStreamClient::WhyNotSent(status) != DataStreamClient::NotSentReason::kUnreachable) return;
  bool ask = false;
  {
    absl::MutexLock lock(&stream_mu_);
    if (stream_ == s) {
      paused_until_ = absl::Now() + kUnreachablePause;
      ask = !asking_;
      asking_ = true;
    }
  }
  if (ask) AskForStream();
}

std::shared_ptr<DataStreamClient> WorkerClient::stream() {
  if (TlsConfigured()) return nullptr;  // the stream is not encrypted
  bool ask = false;
  std::shared_ptr<DataStreamClient> usable;
  {
    absl::MutexLock lock(&stream_mu_);
    const absl::Time now = absl::Now();
    if (stream_ != nullptr && now >= paused_until_) usable = stream_;
    if (stream_ == nullptr && !asking_ && now >= ask_after_) ask = asking_ = true;
  }
  // Asked without waiting: fetches go through gRPC until the answer comes.
  if (ask) AskForStream();
  return usable;
}

void WorkerClient::AskForStream() {
  AsyncUnaryCall<rpc::PingResponse>(
      absl::StrCat("Ping on worker ", address_), token_, rpc::PingRequest(), absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Ping(ctx, req, resp, std::move(done)); })
      .OnReady([this](const absl::StatusOr<rpc::PingResponse>& r) {
        std::shared_ptr<DataStreamClient> old;
        absl::MutexLock lock(&stream_mu_);
        asking_ = false;
        if (!r.ok()) {
          ask_after_ = absl::Now() + kAskAgain;
          return;
        }
        const int port = r->data_port() > 0 && r->data_port() <= 65535 ? r->data_port() : 0;
        if (port == stream_port_ && stream_ != nullptr) return;  // the same port: it rests, as set
        old = std::move(stream_);  // a worker that restarted: its earlier stream is no use
        if (old != nullptr) old->Stop();
        stream_port_ = port;
        paused_until_ = absl::InfinitePast();
        if (port != 0) {
          stream_ = NewStream(address_, port, token_);
        } else {
          ask_after_ = absl::Now() + kUnreachablePause;  // it offers none (TLS, or it could not listen)
        }
      });
}

Future<FetchedShards> WorkerClient::FetchThroughGrpc(const rpc::FetchRequest& request, bool again) {
  Future<FetchedShards> first = AsyncUnaryCallShared<rpc::FetchResponse>(
      absl::StrCat("Fetch on worker ", address_), token_, request, absl::InfiniteDuration(),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->Fetch(ctx, req, resp, std::move(done)); });
  if (!again) return first;
  // A call made while the channel waits between connection attempts fails at once with the last
  // attempt's error ("Connection refused"), even when a worker restarted at this address is back
  // already: the worker is asked again once the channel connects. A fetch only reads, so asking
  // twice is harmless; a worker still unreachable after a few seconds gets the first error.
  Promise<FetchedShards> promise;
  Future<FetchedShards> result = promise.future();
  first.OnReady([this, request, promise = std::move(promise)](const absl::StatusOr<FetchedShards>& r) mutable {
    // Only a call that never reached a worker: errors a worker returns, and a worker that went
    // mid-call, are answered at once.
    if (r.ok() || r.status().code() != absl::StatusCode::kUnavailable ||
        !absl::StrContains(r.status().message(), "failed to connect")) {
      promise.Set(r);
      return;
    }
    WhenReachable(kReachableWait)
        .OnReady([this, request, promise = std::move(promise), first_error = r.status()](
                     const absl::StatusOr<Unit>& up) mutable {
          if (!up.ok()) {
            promise.Set(first_error);
            return;
          }
          FetchThroughGrpc(request, /*again=*/false)
              .OnReady([promise = std::move(promise)](const absl::StatusOr<FetchedShards>& g) mutable { promise.Set(g); });
        });
  });
  return result;
}

Future<Unit> WorkerClient::WhenReachable(absl::Duration wait) {
  return AsyncUnaryCall<rpc::PingResponse>(absl::StrCat("Ping on worker ", address_), token_, rpc::PingRequest(), wait,
                                           [this](auto* ctx, auto* req, auto* resp, auto done) {
                                             ctx->set_wait_for_ready(true);
                                             stub_->async()->Ping(ctx, req, resp, std::move(done));
                                           })
      .Then([](const rpc::PingResponse&) { return Unit{}; });
}

WorkerClientCache& WorkerClientCache::Global() {
  static auto* cache = new WorkerClientCache;  // never destroyed; see the class comment
  return *cache;
}

Future<rpc::GetTraceResponse> WorkerClient::GetTrace(const rpc::GetTraceRequest& request) {
  return AsyncUnaryCall<rpc::GetTraceResponse>(
      absl::StrCat("GetTrace on worker ", address_), token_, request, absl::Seconds(30),
      [this](auto* ctx, auto* req, auto* resp, auto done) { stub_->async()->GetTrace(ctx, req, resp, std::move(done)); });
}

bool WorkerClient::WaitUntilConnected(absl::Time deadline) {
  return channel_->WaitForConnected(absl::ToChronoTime(deadline));
}

std::shared_ptr<WorkerClient> WorkerClientCache::Get(const std::string& address,
                                                     const std::optional<std::string>& token) {
  // An address holds no NUL, so the key tells "no token of its own" from every token.
  const std::string key = token.has_value() ? absl::StrCat(address, std::string(1, '\0'), "=", *token) : address;
  absl::MutexLock lock(&mu_);
  auto& slot = clients_[key];
  if (!slot) slot = std::make_shared<WorkerClient>(address, token);
  return slot;
}

HostOpQueue::HostOpQueue(std::shared_ptr<WorkerClient> worker, ClientIdentity client,
                         std::shared_ptr<RequestPaths> paths, std::shared_ptr<std::atomic<int64_t>> failures)
    : worker_(std::move(worker)), session_(static_cast<int64_t>(absl::Uniform<uint64_t>(absl::BitGen()) >> 1)) {
  queue_ = std::make_shared<OrderedBatchQueue<rpc::Op>>(
      [worker = worker_, client = std::move(client), paths = std::move(paths),
       failures = std::move(failures)](std::vector<rpc::Op> ops) {
        auto request = std::make_shared<rpc::EnqueueRequest>();
        request->set_client_id(client.id);
        request->set_credential(client.credential);
        for (rpc::Op& op : ops) *request->add_ops() = std::move(op);
        Future<Unit> accepted = worker->Enqueue(std::move(request), paths);
        if (failures != nullptr) {
          accepted.OnReady([failures](const absl::StatusOr<Unit>& r) {
            if (!r.ok()) failures->fetch_add(1, std::memory_order_release);
          });
        }
        return accepted;
      },
      nullptr, OrderedBatchQueue<rpc::Op>::BatchLimit{[](const rpc::Op& op) { return op.ByteSizeLong(); }, size_t{64} << 20});  // a worker takes 1 GiB
}

int64_t HostOpQueue::Push(rpc::Op op, Executor* sender) {
  Pushed pushed = PushLeavingSend(std::move(op), sender);
  const int64_t seq = pushed.seq;
  SendPushed(std::move(pushed));
  return seq;
}

void HostOpQueue::SendPushed(Pushed pushed) {
  if (pushed.batch) queue_->SendStarted(*std::move(pushed.batch), pushed.sender);
}

HostOpQueue::Pushed HostOpQueue::PushLeavingSend(rpc::Op op, Executor* sender) {
  Pushed pushed;
  absl::MutexLock lock(&mu_);
  op.set_seq(++seq_);
  op.set_session(session_);
  pushed.seq = seq_;
  OrderedBatchQueue<rpc::Op>::Pushed queued = queue_->PushLeavingSend(std::move(op));
  NotePushedLocked(seq_, queued.number);
  pushed.batch = std::move(queued.batch);
  pushed.sender = sender;
  return pushed;
}

void HostOpQueue::NotePushedLocked(int64_t seq, int64_t item) {
  if (item == 0) return;  // dropped: delivery stopped, and FlushedThrough reports why
  // Entries the host has accepted go first; they are mostly in sequence order (a filled
  // reservation may come late), so pruning stops at the first one still in flight.
  const int64_t acked = queue_->acked();
  while (!unacked_items_.empty() && unacked_items_.begin()->second <= acked) unacked_items_.erase(unacked_items_.begin());
  unacked_items_[seq] = item;
}

int64_t HostOpQueue::ReserveSeq() {
  absl::MutexLock lock(&mu_);
  return ++seq_;
}

int64_t HostOpQueue::ReserveForFill() {
  absl::MutexLock lock(&mu_);
  unfilled_.try_emplace(++seq_);
  return seq_;
}

void HostOpQueue::CatchUp(int64_t seq) {
  absl::MutexLock lock(&mu_);
  seq_ = std::max(seq_, seq);
}

void HostOpQueue::FillReserved(int64_t seq, rpc::Op op) {
  op.set_seq(seq);
  op.set_session(session_);
  Promise<Unit> filled;
  {
    absl::MutexLock lock(&mu_);
    NotePushedLocked(seq, queue_->Push(std::move(op)));
    if (auto it = unfilled_.find(seq); it != unfilled_.end()) {
      filled = std::move(it->second);
      unfilled_.erase(it);
    }
  }
  if (filled.valid()) {
    queue_->Flushed().OnReady([filled = std::move(filled)](const absl::StatusOr<Unit>& r) mutable { filled.Set(r); });
  }
}

Future<Unit> HostOpQueue::Flushed() {
  std::vector<Future<Unit>> all;
  {
    absl::MutexLock lock(&mu_);
    all.push_back(queue_->Flushed());
    for (const auto& [seq, promise] : unfilled_) all.push_back(promise.future());
  }
  return all.size() == 1 ? all[0] : AllDone(all);
}

Future<Unit> HostOpQueue::FlushedThrough(int64_t seq) {
  std::vector<Future<Unit>> all;
  {
    absl::MutexLock lock(&mu_);
    int64_t item = 0;
    for (auto it = unacked_items_.begin(); it != unacked_items_.end() && it->first <= seq; ++it) {
      item = std::max(item, it->second);
    }
    all.push_back(queue_->FlushedThrough(item));
    for (const auto& [reserved, promise] : unfilled_) {
      if (reserved <= seq) all.push_back(promise.future());
    }
  }
  return all.size() == 1 ? all[0] : AllDone(all);
}

void HostOpQueue::SkipReserved(int64_t seq) {
  rpc::Op op;
  op.mutable_skip();
  FillReserved(seq, std::move(op));
}

int64_t HostOpQueue::last_seq() {
  absl::MutexLock lock(&mu_);
  return seq_;
}

}  // namespace pathways
