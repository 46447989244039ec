// What one worker process runs: its devices, its object store, its compiled functions, and the
// ops that clients enqueue on it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "compute/executable.h"
#include "core/executor.h"
#include "device/device.h"
#include "proto/pathways.pb.h"
#include "transport/worker_client.h"
#include "worker/lowered_program.h"
#include "worker/object_store.h"

namespace pathways {

struct HostRuntimeOptions {
  int num_devices = 4;
  int64_t device_memory_bytes = int64_t{1} << 30;
  std::string name = "host";  // used in device names and error messages
  // libtorch's intra-op threads. Process-wide: the last runtime created sets it. One thread per
  // device by default, because the devices are the parallelism.
  int intra_op_threads = 1;
};

// Applies ops in the order they are given. Nothing here blocks on a computation: ops register
// continuations on their inputs' futures, and device work runs on each device's stream.
// Thread-safe.
class HostRuntime {
 public:
  explicit HostRuntime(HostRuntimeOptions options);
  ~HostRuntime();

  const std::string& name() const { return options_.name; }
  // Where this host serves; SendOps addressed here are delivered without the network.
  void set_address(std::string address) { address_ = std::move(address); }
  int num_devices() const { return static_cast<int>(devices_.size()); }
  Device& device(int i) { return *devices_[i]; }
  ObjectStore& store() { return store_; }

  absl::StatusOr<std::string> Compile(const rpc::FunctionBodyProto& body);
  // Applies a batch of one client's ops in order. Errors of individual ops fail the futures of
  // what they produce; only a malformed request is returned here.
  absl::Status Enqueue(const rpc::EnqueueRequest& request);
  void ReceiveTransfer(const rpc::TransferRequest& request);
  // Completes once the requested shards are computed.
  Future<rpc::FetchResponse> Fetch(const rpc::FetchRequest& request);

 private:
  absl::Status ValidateOp(const rpc::Op& op) const;
  absl::Status RegisterProgram(const std::string& client, const rpc::ProgramProto& proto);
  absl::Status RunProgram(const std::string& client, const rpc::RunProgramOp& op);
  // Sends every block that this host holds and another host's shards of `node` need.
  void SendInputs(const std::string& client, const LoweredProgram& program, int node_index,
                  const rpc::RunProgramOp& run);
  // Wires one local shard of `node` to its inputs and enqueues it on its device.
  void ExecuteShard(const std::string& client, const LoweredProgram& program, int node_index,
                    int64_t shard, const rpc::RunProgramOp& run);
  void Send(const std::string& client, ObjectStore::ShardKey source, const Region& region,
            const std::string& dest, const ObjectStore::TransferId& id);
  void Put(const std::string& client, const rpc::PutOp& op);

  const HostRuntimeOptions options_;
  std::string address_;
  std::vector<std::unique_ptr<Device>> devices_;
  ObjectStore store_;
  FunctionCache functions_;
  absl::Mutex programs_mu_;
  absl::flat_hash_map<std::pair<std::string, int64_t>, std::shared_ptr<const LoweredProgram>> programs_
      ABSL_GUARDED_BY(programs_mu_);
  ThreadPool io_pool_;  // serialises transfers and fetch responses off device threads
};

}  // namespace pathways
