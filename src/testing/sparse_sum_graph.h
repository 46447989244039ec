// A small dataflow used by the engine's tests, in one process and across processes:
//   source (4 shards) --sparse--> bucket (6 shards) --all-to-all--> sink (2 shards)
// Sources route value v to bucket v % 3, so buckets 3..5 never receive anything but must still
// learn when each epoch ends. Buckets report their message count per epoch; sinks their total.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "dataflow/engine.h"
#include "dataflow/dataflow_service.h"
#include "grpcpp/server.h"

namespace pathways::dataflow {

// Where shards report "bucketB/eE/count" and "sinkS/eE" results. Thread-safe.
class SparseSumResults {
 public:
  // Called for each result as it is recorded, outside the lock (e.g. to print it).
  explicit SparseSumResults(std::function<void(const std::string&, int64_t)> on_record = nullptr)
      : on_record_(std::move(on_record)) {}
  void Record(const std::string& key, int64_t value);
  bool WaitFor(size_t n, absl::Duration timeout);
  int64_t Get(const std::string& key);  // -1 when absent
  size_t size();

 private:
  std::function<void(const std::string&, int64_t)> on_record_;
  absl::Mutex mu_;
  std::map<std::string, int64_t> values_ ABSL_GUARDED_BY(mu_);
};

// hosts: three host names; shards are spread over them.
std::shared_ptr<GraphDef> MakeSparseSumGraph(const std::vector<std::string>& hosts);
OperatorFactory SparseSumOperators(SparseSumResults& results);

// Drives `epochs` overlapping epochs from the source shards that `engine` hosts: injects values
// of every epoch interleaved, then closes the inputs in a shuffled order. Returns, per epoch, the
// expected totals of sink 0 and sink 1 for all sources (every driver must use the same seed).
std::map<int64_t, std::pair<int64_t, int64_t>> DriveSparseSum(Engine& engine, int epochs, uint32_t seed);

// A DataflowService served on a free loopback port, as a host of the tests' dataflows.
struct LoopbackDataflowHost {
  DataflowService service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<StreamListener> streams;  // with `streams`: batches over plain TCP too
  std::string address;
  ~LoopbackDataflowHost();
};
absl::StatusOr<std::unique_ptr<LoopbackDataflowHost>> StartLoopbackDataflowHost(bool streams = false);

}  // namespace pathways::dataflow
