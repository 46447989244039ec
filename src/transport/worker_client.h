// How clients talk to workers: WorkerClient (asynchronous calls, one per worker address) and
// HostOpQueue (ordered, batched op delivery from one client to one host). Worker-to-worker data
// moves through the sharded dataflow engine (src/dataflow).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways {

// Asynchronous calls to one worker. Thread-safe. Futures complete on gRPC's callback threads:
// continuations that do real work should hop to an executor.
class WorkerClient {
 public:
  explicit WorkerClient(std::string address);
  const std::string& address() const { return address_; }

  Future<rpc::CompileResponse> Compile(const rpc::CompileRequest& request);
  Future<rpc::EnqueueResponse> Enqueue(const rpc::EnqueueRequest& request);
  // No deadline: a fetch waits for the computation that produces the data.
  Future<rpc::FetchResponse> Fetch(const rpc::FetchRequest& request);
  Future<rpc::GetTraceResponse> GetTrace(const rpc::GetTraceRequest& request);

 private:
  template <typename Request, typename Response, typename Method>
  Future<Response> Call(const char* what, const Request& request, Method method,
                        absl::Duration timeout);

  const std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpc::Worker::Stub> stub_;
};

// Shares one WorkerClient (and so one channel) per address. Thread-safe.
//
// The process-wide cache keeps every channel for the life of the process. That is deliberate:
// the last reference to a channel can otherwise be dropped inside one of its own completion
// callbacks (an op queue or array freed when its final call completes), and destroying a channel
// on gRPC's callback thread crashes Debian's gRPC 1.51 (seen as a SIGSEGV in
// grpc_completion_queue_next on "nexting_thread"). Channels are few: one per worker address.
class WorkerClientCache {
 public:
  static WorkerClientCache& Global();
  std::shared_ptr<WorkerClient> Get(const std::string& address);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<WorkerClient>> clients_ ABSL_GUARDED_BY(mu_);
};

// Delivers one client's ops to one host in order. Push never blocks: ops queue up while a batch
// is in flight and go out together in the next one. Thread-safe. Held by shared_ptr: in-flight
// calls keep it alive.
class HostOpQueue : public std::enable_shared_from_this<HostOpQueue> {
 public:
  HostOpQueue(std::shared_ptr<WorkerClient> worker, std::string client_id);
  void Push(rpc::Op op);
  // Completes when every op pushed so far has been accepted by the host, or with the error that
  // stopped delivery (after which every later op fails too).
  Future<Unit> Flushed();
  const std::string& address() const { return worker_->address(); }

 private:
  rpc::EnqueueRequest TakeBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Send(rpc::EnqueueRequest request);
  void OnBatchDone(absl::Status status);

  std::shared_ptr<WorkerClient> worker_;
  const std::string client_id_;
  absl::Mutex mu_;
  std::vector<rpc::Op> pending_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pushed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_flight_end_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, Promise<Unit>>> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
