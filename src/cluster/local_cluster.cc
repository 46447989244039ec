#include "cluster/local_cluster.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const LocalClusterOptions& options) {
  if (options.num_islands < 1 || options.hosts_per_island < 1 || options.devices_per_host < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a local cluster needs at least one island, host per island and "
                                                   "device per host; asked for ",
                                                   options.num_islands, " islands of ", options.hosts_per_island,
                                                   " hosts of ", options.devices_per_host, " devices"));
  }
  // Every host is served from this process, as a worker's --hosts serves at most 4096.
  if (int64_t{options.num_islands} * options.hosts_per_island > 4096 || options.devices_per_host > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("a local cluster has at most 4096 hosts of at most 4096 devices; "
                     "asked for ",
                     options.num_islands, " islands of ", options.hosts_per_island, " hosts of ",
                     options.devices_per_host, " devices"));
  }
  if (options.dcn.latency < absl::ZeroDuration() || options.dcn.latency > absl::Seconds(10)) {
    return absl::InvalidArgumentError(absl::StrCat("the emulated link's latency must be 0 to 10 s, got ",
                                                   absl::FormatDuration(options.dcn.latency)));
  }
  if (!(options.dcn.gbps >= 0) || options.dcn.gbps > 1e6) {
    return absl::InvalidArgumentError(
        absl::StrCat("the emulated link's bandwidth must be 0 (unlimited) to 1e6 Gbit/s, got ", options.dcn.gbps));
  }
  std::unique_ptr<LocalCluster> cluster(new LocalCluster);
  cluster->options_ = options;
  ControllerOptions controller;
  controller.scheduler = options.scheduler;
  controller.heartbeat_timeout = options.heartbeat_timeout;
  cluster->controller_ = std::make_unique<Controller>(controller);
  PW_RETURN_IF_ERROR(cluster->controller_->Start());
  for (int island = 0; island < options.num_islands; ++island) {
    for (int h = 0; h < options.hosts_per_island; ++h) PW_RETURN_IF_ERROR(cluster->AddWorker(island).status());
  }
  return cluster;
}

absl::StatusOr<int> LocalCluster::AddWorker(int island) {
  WorkerOptions w;
  w.controller_address = controller_->address();
  w.island = island;
  w.num_devices = options_.devices_per_host;
  w.backend = options_.backend;
  w.device_memory_bytes = options_.device_memory_bytes;
  w.collective_timeout = options_.collective_timeout;
  w.memory_wait = options_.memory_wait;
  w.dcn = options_.dcn;
  w.data_directories = options_.data_directories;
  w.checkpoint_directory = options_.checkpoint_directory;
  auto worker = std::make_unique<Worker>(w);
  PW_RETURN_IF_ERROR(worker->Start());  // returns once registered
  workers_.push_back(std::move(worker));
  return static_cast<int>(workers_.size()) - 1;
}

LocalCluster::~LocalCluster() {
  // The controller stops first: its schedulers would otherwise send to workers already gone
  // (retiring the clients that just left, say) and wait out their grace period.
  controller_->Shutdown();
  for (auto& w : workers_) w->Shutdown();
  workers_.clear();
  controller_.reset();
}

}  // namespace pathways
