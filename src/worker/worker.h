// A worker process's parts put together: the host runtime, its gRPC server, and its registration
// and heartbeats with the controller.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/notification.h"
#include "core/ids.h"
#include "grpcpp/server.h"
#include "dataflow/dataflow_service.h"
#include "transport/controller_client.h"
#include "worker/data_stream_server.h"
#include "worker/host_runtime.h"
#include "worker/worker_service.h"

namespace pathways {

struct WorkerOptions {
  std::string controller_address;
  std::string listen_address = "127.0.0.1:0";  // port 0: pick a free port
  int island = 0;
  int num_devices = 4;
  // The devices' kind: cpu, or simulated devices whose kernels take modelled durations
  // (compute/device_backend.h).
  DeviceBackend backend;
  int64_t device_memory_bytes = int64_t{1} << 30;
  // What the functions compiled on this worker may keep in all, and for one client (or named
  // tenant) (compute/function_cache.h).
  int64_t compiled_memory_bytes = FunctionCache::kDefaultLimit;
  int64_t compiled_memory_per_client_bytes = FunctionCache::kDefaultAccountLimit;
  int intra_op_threads = 1;
  // How long a collective waits for its group before it fails its run.
  absl::Duration collective_timeout = absl::Seconds(30);
  // How long a computation waits for device memory held by other work before it fails.
  absl::Duration memory_wait = absl::Seconds(10);
  // Tenants' calls to this worker must carry this token; empty: PATHWAYS_TOKEN, or none when
  // unset. Calls that only the controller and other workers make (control graphs, dataflow
  // streams, links between hosts) must carry the cluster token; empty: PATHWAYS_CLUSTER_TOKEN,
  // else `token` (transport/auth.h). The worker's own calls carry the process's token, which the
  // `pathways worker` command sets to the cluster token.
  std::string token;
  std::string cluster_token;
  // Named tenants' tokens, a line `NAME TOKEN` each (transport/tenant_tokens.h), admitted beside
  // `token`; empty: none. Needs a cluster token.
  std::string tenants_file;
  // Fixed ports for what a worker serves beside its gRPC port (firewalls, network policies): the
  // data stream clients put and fetch through, and the links other hosts meet it on for
  // collectives and blocks. 0: any free port. A fixed port that cannot be had fails Start.
  int data_port = 0;
  int links_port = 0;
  absl::Duration register_timeout = absl::Seconds(30);
  // The emulated network to other islands' hosts (core/dcn_emulation.h); off by default.
  DcnOptions dcn;
  // Directories whose files compiled functions may read as training data
  // (`pathways.text_tokens`, compute/text_source.h); none by default. Process-wide once allowed.
  std::vector<std::string> data_directories;
  // Where compiled functions save and load checkpoint shards (compute/checkpoint_files.h); empty:
  // nowhere, so saving fails. Process-wide once set.
  std::string checkpoint_directory;
  // Called (from the heartbeat thread) when the controller says this worker was silent past its
  // heartbeat timeout and was declared dead: its state is stale (its runs failed elsewhere, its
  // peers gave up on it), so it leaves; a new process rejoins as a new incarnation. The
  // `pathways worker` command exits with this status. Null: the worker only stops heartbeating.
  std::function<void(const absl::Status&)> on_left;
  // A computation that has run longer than this on a device is asked to stop (see
  // ComputationWatch; a body stops at the next turn of a loop): its run fails and the controller
  // refuses its client. One still running once its waits could have timed out is stuck: the worker
  // tells the controller why and leaves, with on_left, as above; its runs fail. Zero or infinite:
  // never.
  absl::Duration computation_timeout = absl::Minutes(10);
  // A peer host that took nothing of the dataflow batches waiting for it this long, at two
  // heartbeats in a row, is named to the controller, which makes one of the two leave (see
  // ClusterRegistry::ReportUnreachable): runs between them would wait for good. Zero or
  // infinite: never.
  absl::Duration peer_stall_timeout = absl::Seconds(15);
};

// Start() serves and registers; the destructor stops heartbeats and the server. Thread-safe.
class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();

  // Serves on the listen address, then registers with the controller, retrying until
  // register_timeout passes.
  absl::Status Start();
  void Shutdown();
  const std::string& address() const { return address_; }
  int32_t host_id() const { return host_id_.load(); }
  HostRuntime& runtime() { return *runtime_; }
  // Whether it left because a device was stuck in a computation: its device threads cannot be
  // stopped, so the process cannot shut down cleanly and should exit at once.
  bool stuck() const { return stuck_.load(); }

 private:
  absl::Status Register();
  void HeartbeatLoop();
  // Asks the computations past the computation timeout to stop, naming them in `request`; returns
  // why the worker must leave when one asked earlier is still running, and names its client.
  absl::Status StopOverruns(rpc::HeartbeatRequest& request);
  rpc::RegisterWorkerRequest RegistrationRequest();
  // What the controller refuses (`refusals`, or only `names` from a controller of an earlier
  // version) becomes this host's copy.
  void SetRefusals(const google::protobuf::RepeatedPtrField<rpc::TenantRefusal>& refusals,
                   const google::protobuf::RepeatedPtrField<std::string>& names);
  // `recent_work`: also each device's work since the last call that asked for it (heartbeats).
  void DescribeDevices(google::protobuf::RepeatedPtrField<rpc::DeviceInfo>* devices, bool recent_work = false);

  const WorkerOptions options_;
  const std::string incarnation_ = RandomIdString();
  // Declared before the runtime, which unregisters its graphs from it when destroyed.
  dataflow::DataflowService dataflow_service_;  // batches of the dataflow engine from other hosts
  std::unique_ptr<HostRuntime> runtime_;
  RefusedTenants refused_tenants_;  // as the controller's heartbeat answers name them; outlives the servers
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<DataStreamServer> data_stream_;  // none with TLS (it is not encrypted)
  std::unique_ptr<ControllerClient> controller_;
  std::string address_;
  std::atomic<int32_t> host_id_{-1};
  std::atomic<int64_t> heartbeat_ms_{500};
  std::atomic<bool> stuck_{false};
  absl::Notification stop_;
  std::thread heartbeat_thread_;
  std::vector<int64_t> work_reported_until_us_;  // per device; the heartbeat thread's own
  // Computations asked to stop that no controller has heard of yet; the heartbeat thread's own.
  std::vector<rpc::StoppedComputation> unreported_stops_;
  // The clients this host held when it last named them to the controller (see
  // HeartbeatRequest.clients); the heartbeat thread's own (Start registers before it starts).
  absl::flat_hash_set<std::string> named_clients_;
  // Peers found stalled at the last heartbeat (see peer_stall_timeout); the heartbeat thread's own.
  absl::flat_hash_set<std::string> stalled_peers_;
  // Hosts the controller last said had left the cluster (heartbeat thread only): batches for
  // them that go nowhere are no news, and are neither named to it nor logged again.
  absl::flat_hash_set<std::string> departed_;
  // Fills `request` with the peers stalled now and at the last heartbeat: a peer stalled only
  // once may have waited while this process itself was frozen.
  void NameStalledPeers(rpc::HeartbeatRequest& request);
};

}  // namespace pathways
