// The controller process's parts behind one gRPC service: the cluster registry (resource
// manager), client leases, one gang scheduler per island, and the rendezvous store for collective links.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/notification.h"
#include "controller/client_leases.h"
#include "controller/cluster_registry.h"
#include "controller/island_control.h"
#include "controller/island_scheduler.h"
#include "controller/schedule_admission.h"
#include "core/executor.h"
#include "core/ids.h"
#include "dataflow/dataflow_service.h"
#include "dataflow/grpc_transport.h"
#include "grpcpp/server.h"
#include "ops/status_http_server.h"
#include "proto/pathways.grpc.pb.h"
#include "transport/stream_listener.h"

namespace pathways {

struct ControllerOptions {
  std::string listen_address = "127.0.0.1:0";  // port 0: pick a free port
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // A client that has not heartbeated for this long is gone: workers free what it owned.
  absl::Duration client_timeout = absl::Seconds(3);
  IslandSchedulerOptions scheduler;  // every island's
  // Tenants' calls must carry this token; empty: PATHWAYS_TOKEN, or none when unset.
  std::string token;
  // Calls that only workers make (registering, heartbeats, rendezvous, dataflow streams) must
  // carry this one; empty: PATHWAYS_CLUSTER_TOKEN, else `token` (see transport/auth.h).
  std::string cluster_token;
  // Named tenants' tokens, a line `NAME TOKEN` each (transport/tenant_tokens.h), admitted beside
  // `token`; empty: none. Needs a cluster token.
  std::string tenants_file;
  // The dashboard, /api/status and /metrics over HTTP (ops/status_http_server.h), on the listen
  // address's IP (127.0.0.1 instead when TLS is on: it has no TLS of its own) and the tenants'
  // token: -1 off, 0 any free port.
  int http_port = -1;
  // The plain TCP streams (hosts' dataflow batches, clients' schedule streams) on the listen
  // address's IP: 0 any free port. Off with TLS (they are not encrypted).
  int stream_port = 0;
  // Test-only: runs over several islands reach each island's scheduler independently, 1 ms
  // apart, every second client (in the order the controller first sees them) reaching the
  // islands last to first, as if islands were not ordered together: gangs over several islands
  // then meet out of order.
  bool TEST_unordered_islands = false;
};


// Thread-safe.
class Controller {
 public:
  explicit Controller(ControllerOptions options);
  ~Controller();
  absl::Status Start();
  void Shutdown();
  const std::string& address() const { return address_; }
  // Where the HTTP server listens; 0 when it is off.
  int http_port() const { return http_ == nullptr ? 0 : http_->port(); }
  // The IP the dashboard serves on (valid while http_port() is not 0).
  const std::string& http_ip() const { return http_ip_; }
  ClusterRegistry& registry() { return registry_; }
  // The island's scheduler, created at its first run, with the control graph through which it
  // reaches the island's hosts.
  IslandScheduler& scheduler(int island);
  // Hands a run that spans several islands (one part per island) to their schedulers, which send
  // it only once each has reached its part, one such run at a time (cross_island.h): all such
  // runs are then in one order on every island, under either policy.
  // The cluster as `pathways status` and the dashboard show it: hosts and devices, slices,
  // island schedulers and live clients, and the devices' work of the last `timeline` (none by
  // default; the registry keeps 30 s). Clients appear by a label (ClientLabel).
  rpc::ClusterStatus Status(absl::Duration timeline = absl::ZeroDuration());
  // How far back the dashboard's device timelines reach (and `pathways status --json`'s).
  static constexpr absl::Duration kDashboardTimeline = absl::Seconds(10);
  Future<Unit> SubmitAcrossIslands(const std::string& client, double weight,
                                   std::vector<std::pair<int, rpc::GangRun>> parts);

 private:
  class Service;
  struct Island {  // members go in reverse: the scheduler before the plane it pushes to
    std::unique_ptr<IslandControlPlane> control;
    std::unique_ptr<IslandScheduler> scheduler;
  };
  void RetireLoop();
  // Each island's control graph follows the registry's live hosts.
  void UpdateMembers(const std::vector<ClusterRegistry::LiveHost>& live);
  static std::vector<IslandControlPlane::Member> MembersOf(int island,
                                                           const std::vector<ClusterRegistry::LiveHost>& live);
  const ControllerOptions options_;
  const std::string incarnation_ = RandomIdString();
  std::unique_ptr<ScheduleAdmission> admission_;  // made in Start, before anything is served
  ClusterRegistry registry_;
  ClientLeases clients_;
  // The controller's shards of the island control graphs.
  dataflow::DataflowService dataflow_service_;
  std::unique_ptr<dataflow::GrpcTransport> dataflow_transport_;
  ThreadPool dataflow_pool_{"ctl-dataflow", 2};
  CrossIslandOrder cross_island_order_;  // declared first: the schedulers' runs point to it
  absl::Mutex schedulers_mu_;
  std::map<int, Island> schedulers_ ABSL_GUARDED_BY(schedulers_mu_);
  // TEST_unordered_islands: each client's rank among the clients seen.
  absl::flat_hash_map<std::string, int> TEST_client_ranks_ ABSL_GUARDED_BY(schedulers_mu_);
  absl::Notification stop_;
  std::thread retire_thread_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string http_ip_;
  std::unique_ptr<StatusHttpServer> http_;
  // Plain TCP streams beside the gRPC port: hosts' dataflow batches (and clients' schedule
  // streams); none with TLS (they are not encrypted).
  std::unique_ptr<StreamListener> streams_;
  std::string address_;
};

}  // namespace pathways
