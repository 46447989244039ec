// How clients talk to workers: WorkerClient (asynchronous calls, one per worker address) and
// HostOpQueue (ordered, batched op delivery from one client to one host). Worker-to-worker data
// moves through the sharded dataflow engine (src/dataflow).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"
#include "transport/auth.h"
#include "transport/data_stream.h"
#include "transport/ordered_batch_queue.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways {

// One client's op batches and fetches to workers, by the way each went: over a data stream, or
// through gRPC (no stream known or idle, or the worker never served it on the stream). Counted
// once the way is settled (ClientStats).
struct RequestPaths {
  std::atomic<int64_t> streamed{0}, grpc{0};
};

// Asynchronous calls to one worker. Thread-safe. Futures complete on RpcCompletions(), never on
// gRPC's own threads.
class WorkerClient {
 public:
  // Calls and streams show `token` when given, else the process's token (TokenOr, at each call).
  explicit WorkerClient(std::string address, std::optional<std::string> token = std::nullopt);
  const std::string& address() const { return address_; }
  // Connects the channel, waiting until `deadline`; false if it is not connected by then. A
  // worker that restarted at this address is only reached once the channel reconnects, and
  // calls fail at once until then.
  bool WaitUntilConnected(absl::Time deadline);

  Future<rpc::CompileResponse> Compile(const rpc::CompileRequest& request);
  // A client's ops, over the worker's data stream when one is known and idle (and the request
  // small), else through gRPC. Shared: a fallback to gRPC sends the same request without a copy.
  // Counted in `paths` when given.
  Future<Unit> Enqueue(std::shared_ptr<const rpc::EnqueueRequest> request,
                       std::shared_ptr<RequestPaths> paths = nullptr);
  // The controller asks the host to join its island's control graph.
  Future<rpc::JoinControlGraphResponse> JoinControlGraph(const rpc::ControlGraph& request);
  // No deadline: a fetch waits for the computation that produces the data. Goes over the
  // worker's data stream (transport/data_stream.h) once the worker said where it is (the first
  // fetch asks, and goes through gRPC), else through gRPC. At most `max_bytes` of shard data.
  Future<FetchedShards> Fetch(const rpc::FetchRequest& request, uint64_t max_bytes,
                              std::shared_ptr<RequestPaths> paths = nullptr);
  // Whether a data stream to the worker is known and usable now (asks the worker where it is
  // when none is known, without waiting).
  bool HasStream() { return stream() != nullptr; }
  // Sends a put's bytes ahead over the worker's data stream, where they wait for the put op that
  // names them. Complete once the worker holds them; fails when there is no stream (none known
  // yet, TLS), every connection is busy, or the stream failed: the caller then sends the bytes
  // with the op through gRPC.
  Future<Unit> Stage(const rpc::StageRequest& request, std::shared_ptr<const std::string> bytes);
  Future<rpc::GetTraceResponse> GetTrace(const rpc::GetTraceRequest& request);

 private:

  // Through gRPC; a call that fails Unavailable is made once more when the channel connects
  // within a few seconds (see the definition), when `again` is set.
  Future<FetchedShards> FetchThroughGrpc(const rpc::FetchRequest& request, bool again = true);
  // Complete once the channel is connected (a ping waits for it), or failed after `wait`.
  Future<Unit> WhenReachable(absl::Duration wait);
  Future<Unit> EnqueueThroughGrpc(const rpc::EnqueueRequest& request);
  // What `streamed` (a request sent on `s`, or nullopt when it could not be) answers, or, when
  // it was never sent or never served, what `grpc` sends the same request through gRPC answers.
  // The way it went is counted in `paths` (when given).
  template <typename T>
  Future<T> StreamElseGrpc(const std::shared_ptr<DataStreamClient>& s, std::optional<Future<T>> streamed,
                           std::function<Future<T>()> grpc, std::shared_ptr<RequestPaths> paths);
  // The data stream, when one is known and not resting; asks the worker where it is when none is.
  std::shared_ptr<DataStreamClient> stream();
  // Pings the worker for its stream port (asking_ is set by the caller).
  void AskForStream();
  // A request on `s` failed with `status`: a stream that could not be dialed rests, and the
  // worker is asked again where its stream is.
  void NoteStreamFailure(const std::shared_ptr<DataStreamClient>& s, const absl::Status& status);

  const std::string address_;
  const std::optional<std::string> token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::Worker::Stub> stub_;
  absl::Mutex stream_mu_;
  std::shared_ptr<DataStreamClient> stream_ ABSL_GUARDED_BY(stream_mu_);  // null: none known
  int stream_port_ ABSL_GUARDED_BY(stream_mu_) = 0;
  bool asking_ ABSL_GUARDED_BY(stream_mu_) = false;
  absl::Time ask_after_ ABSL_GUARDED_BY(stream_mu_) = absl::InfinitePast();
  absl::Time paused_until_ ABSL_GUARDED_BY(stream_mu_) = absl::InfinitePast();  // its port could not be dialed
};

// Shares one WorkerClient (and so one channel) per address and token. Thread-safe.
//
// The process-wide cache keeps every channel for the life of the process. That is deliberate:
// the last reference to a channel can otherwise be dropped inside one of its own completion
// callbacks (an op queue or array freed when its final call completes), and destroying a channel
// on gRPC's callback thread crashes Debian's gRPC 1.51 (seen as a SIGSEGV in
// grpc_completion_queue_next on "nexting_thread"). Channels are few: one per worker address, and
// one more per other token that clients of this process show it (each client its cluster's).
class WorkerClientCache {
 public:
  static WorkerClientCache& Global();
  // One per address and token (clients of one process may show different clusters' tokens).
  std::shared_ptr<WorkerClient> Get(const std::string& address, const std::optional<std::string>& token = std::nullopt);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<WorkerClient>> clients_ ABSL_GUARDED_BY(mu_);
};

// Delivers one client's ops to one host in order, each stamped with the next number of the
// client's sequence for that host. Runs travel to hosts through their island's scheduler
// instead, with a number reserved here or, for a run that names only its group (see
// ClientCore::RunGroup), taken without this queue and counted here later (CatchUp): hosts apply each client's ops in sequence order
// whichever way they came, so a run never overtakes a Put or Free sent before it, or the other
// way round. Thread-safe. Held by shared_ptr.
class HostOpQueue {
 public:
  // Batches are counted in `paths` (when given); `failures` (when given) counts batches the host
  // refused or that could not reach it, each of which stops delivery.
  HostOpQueue(std::shared_ptr<WorkerClient> worker, ClientIdentity client,
              std::shared_ptr<RequestPaths> paths = nullptr,
              std::shared_ptr<std::atomic<int64_t>> failures = nullptr);
  // Returns the op's sequence number. With `sender`, a batch this push starts is sent from one
  // of its threads instead of this one (the op keeps its number and place).
  int64_t Push(rpc::Op op, Executor* sender = nullptr);
  // As Push, numbering and queueing the op here but leaving a batch it starts to SendPushed, to
  // be called holding no lock (see ClientCore::Push).
  struct Pushed {
    int64_t seq = 0;
    std::optional<std::vector<rpc::Op>> batch;  // the batch this push started, if any
    Executor* sender = nullptr;
  };
  Pushed PushLeavingSend(rpc::Op op, Executor* sender = nullptr);
  void SendPushed(Pushed pushed);
  // A sequence number for an op that reaches the host another way (through the scheduler).
  int64_t ReserveSeq();
  // A sequence number for an op this queue sends later (a put whose bytes go ahead over a data
  // stream), with FillReserved: Flushed() waits for it meanwhile.
  int64_t ReserveForFill();
  // Sends `op` at a number from ReserveForFill (or ReserveSeq).
  void FillReserved(int64_t seq, rpc::Op op);
  // Numbers up to `seq` were taken elsewhere (runs that named this host only through their
  // group): the next number handed out is above it.
  void CatchUp(int64_t seq);
  // Fills a reserved number whose op will never arrive (the scheduler refused it) with an op
  // that does nothing, so the host does not wait for it.
  void SkipReserved(int64_t seq);
  // The last sequence number handed out here (ClientCore::LastSeq adds the runs of groups).
  int64_t last_seq();
  // This queue's sequence on the host (random): a new queue starts a new one.
  int64_t session() const { return session_; }
  // Delivery stopped (the host refused a batch or could not be reached): the client replaces the
  // queue, and with it the session, so a host that restarted is usable again.
  bool failed() { return queue_->failed(); }
  absl::Status failure() { return queue_->failure(); }
  // Completes when every op pushed so far, and every one reserved with ReserveForFill, has been
  // accepted by the host (not those reserved for the scheduler), or with the error that stopped
  // delivery (after which every later op fails too).
  Future<Unit> Flushed();
  // As Flushed, for the ops numbered `seq` or less only: what a fetch of that op's results
  // needs, without waiting for ops pushed after it (frees, say).
  Future<Unit> FlushedThrough(int64_t seq);
  const std::string& address() const { return worker_->address(); }

 private:
  std::shared_ptr<WorkerClient> worker_;
  std::shared_ptr<OrderedBatchQueue<rpc::Op>> queue_;
  const int64_t session_;
  absl::Mutex mu_;  // orders numbering with pushing
  int64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Numbers from ReserveForFill not filled yet: each completes once its op is accepted.
  absl::flat_hash_map<int64_t, Promise<Unit>> unfilled_ ABSL_GUARDED_BY(mu_);
  // Pushed ops the host may not have accepted yet: sequence number -> the queue's item number.
  std::map<int64_t, int64_t> unacked_items_ ABSL_GUARDED_BY(mu_);
  void NotePushedLocked(int64_t seq, int64_t item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace pathways
