#include "client/local_cluster.h"

#include "core/status_macros.h"

namespace pathways {

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const LocalClusterOptions& options) {
  std::unique_ptr<LocalCluster> cluster(new LocalCluster);
  ControllerOptions controller;
  controller.scheduler = options.scheduler;
  cluster->controller_ = std::make_unique<Controller>(controller);
  PW_RETURN_IF_ERROR(cluster->controller_->Start());
  for (int island = 0; island < options.num_islands; ++island) {
    for (int h = 0; h < options.hosts_per_island; ++h) {
      WorkerOptions w;
      w.controller_address = cluster->controller_->address();
      w.island = island;
      w.num_devices = options.devices_per_host;
      w.device_memory_bytes = options.device_memory_bytes;
      w.collective_timeout = options.collective_timeout;
      auto worker = std::make_unique<Worker>(w);
      PW_RETURN_IF_ERROR(worker->Start());  // returns once registered
      cluster->workers_.push_back(std::move(worker));
    }
  }
  return cluster;
}

LocalCluster::~LocalCluster() {
  for (auto& w : workers_) w->Shutdown();
  workers_.clear();
  controller_.reset();
}

}  // namespace pathways
