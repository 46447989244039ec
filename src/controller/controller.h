// The controller process's parts behind one gRPC service: the cluster registry (resource
// manager), client leases, one gang scheduler per island, and the rendezvous store for Gloo.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "controller/client_leases.h"
#include "controller/cluster_registry.h"
#include "controller/island_scheduler.h"
#include "grpcpp/server.h"
#include "proto/pathways.grpc.pb.h"

namespace pathways {

struct ControllerOptions {
  std::string listen_address = "127.0.0.1:0";  // port 0: pick a free port
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // A client that has not heartbeated for this long is gone: workers free what it owned.
  absl::Duration client_timeout = absl::Seconds(3);
  IslandSchedulerOptions scheduler;  // every island's
  // Calls must carry this token; empty: PATHWAYS_TOKEN, or none when unset.
  std::string token;
};

// Thread-safe.
class Controller {
 public:
  explicit Controller(ControllerOptions options);
  ~Controller();
  absl::Status Start();
  void Shutdown();
  const std::string& address() const { return address_; }
  ClusterRegistry& registry() { return registry_; }
  // The island's scheduler, created at its first run.
  IslandScheduler& scheduler(int island);

 private:
  class Service;
  class HostQueues;
  void RetireLoop();
  const ControllerOptions options_;
  ClusterRegistry registry_;
  ClientLeases clients_;
  std::unique_ptr<HostQueues> host_queues_;
  absl::Mutex schedulers_mu_;
  std::map<int, std::unique_ptr<IslandScheduler>> schedulers_ ABSL_GUARDED_BY(schedulers_mu_);
  absl::Notification stop_;
  std::thread retire_thread_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace pathways
