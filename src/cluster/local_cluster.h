// A whole cluster inside one process: a controller and workers on loopback, over the same code
// paths (gRPC included) as separate processes. For the demo, tests and benchmarks.
#pragma once

#include <memory>
#include <vector>

#include "client/client.h"
#include "controller/controller.h"
#include "worker/worker.h"

namespace pathways {

struct LocalClusterOptions {
  int num_islands = 2;
  int hosts_per_island = 2;
  int devices_per_host = 4;
  int64_t device_memory_bytes = int64_t{256} << 20;
  absl::Duration collective_timeout = absl::Seconds(30);
  absl::Duration memory_wait = absl::Seconds(10);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  IslandSchedulerOptions scheduler;
  // Traffic between islands crosses an emulated data-centre network (core/dcn_emulation.h).
  DcnOptions dcn;
  // Where compiled functions may read data files (WorkerOptions::data_directories).
  std::vector<std::string> data_directories;
  // Where compiled functions keep checkpoint shards (WorkerOptions::checkpoint_directory).
  std::string checkpoint_directory;
  // cpu devices, or simulated ones with modelled kernels (compute/device_backend.h).
  DeviceBackend backend;
};

// Not copyable. The destructor stops the workers, then the controller.
class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);
  ~LocalCluster();

  const std::string& controller_address() const { return controller_->address(); }
  absl::StatusOr<std::unique_ptr<Client>> Connect() const { return Client::Connect(controller_address()); }
  int num_workers() const { return static_cast<int>(workers_.size()); }
  Worker& worker(int i) { return *workers_[i]; }
  // Hosts joining and leaving while the cluster runs. A stopped worker stops serving and
  // heartbeating (the controller takes it out after the heartbeat timeout); its object stays, so
  // indices do not move. AddWorker returns the new worker's index.
  void StopWorker(int i) { workers_[i]->Shutdown(); }
  absl::StatusOr<int> AddWorker(int island);

 private:
  LocalCluster() = default;
  LocalClusterOptions options_;
  std::unique_ptr<Controller> controller_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace pathways
