// What one worker process runs: its devices, its object store, its compiled functions, and the
// ops that clients enqueue on it.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/notification.h"
#include "array/resharding.h"
#include "collective/block_streams.h"
#include "collective/collective.h"
#include "compute/device_backend.h"
#include "compute/executable.h"
#include "compute/function_cache.h"
#include "core/dcn_emulation.h"
#include "core/executor.h"
#include "dataflow/dataflow_service.h"
#include "dataflow/dcn_transport.h"
#include "dataflow/engine.h"
#include "dataflow/grpc_transport.h"
#include "device/device.h"
#include "proto/pathways.pb.h"
#include "transport/worker_client.h"
#include "worker/computation_watch.h"
#include "worker/host_control.h"
#include "worker/lowered_program.h"
#include "worker/object_store.h"
#include "worker/op_sequencer.h"
#include "worker/program_plan.h"

namespace pathways {

struct HostRuntimeOptions {
  int num_devices = 4;
  int64_t device_memory_bytes = int64_t{1} << 30;
  // The address this host serves at: its name in programs, device names and error messages.
  std::string name = "host";
  // Where batches of the dataflow engine arrive for this host (not owned; served by the worker's
  // gRPC server). Programs register their dataflow graphs with it.
  dataflow::DataflowService* dataflow_service = nullptr;
  // libtorch's intra-op threads. Process-wide: the last runtime created sets it. One thread per
  // device by default, because the devices are the parallelism.
  int intra_op_threads = 1;
  // Where hosts meet to connect for collectives that span hosts (the controller's store across
  // processes); null keeps collectives within this host. Collective links listen on the address in `name`.
  std::shared_ptr<collective::KeyValueStore> rendezvous;
  // How long a collective waits for the rest of its group before failing its run.
  absl::Duration collective_timeout = absl::Seconds(30);
  // How long a computation waits for device memory held by other work before it fails with
  // ResourceExhausted. Bounded on purpose: a program waiting for memory that only its own later
  // nodes would free (they queue behind it on the in-order device) is reported, not hung.
  absl::Duration memory_wait = absl::Seconds(10);
  // How long a scheduled run waits for earlier ops of its client before going ahead (see
  // OpSequencer).
  absl::Duration sequence_gap_timeout = absl::Seconds(10);
  // This worker process's random identity (see RegisterWorkerRequest); fetches for arrays placed
  // on another process at the same address are refused.
  std::string incarnation;
  // This host's island, and the emulated network to other islands' hosts (collectives and
  // dataflow transfers); disabled by default.
  int island = 0;
  DcnOptions dcn;
  // What this host proves to others when it connects for collectives and blocks (the cluster
  // token; see transport/auth.h): hosts that do not share it cannot connect.
  std::string cluster_token;
  // The port this host listens on for collectives and blocks from other hosts; 0: any free one.
  int links_port = 0;
  // What the devices are and how bodies compile for them (cpu, or simulated for scale runs).
  DeviceBackend backend;
  // What the functions compiled here may keep in all, and for one client (or named tenant)
  // (FunctionCache): past either, compiles fail.
  int64_t compiled_memory_bytes = FunctionCache::kDefaultLimit;
  int64_t compiled_memory_per_client_bytes = FunctionCache::kDefaultAccountLimit;
};

// Applies each client's ops in its order, and scheduled runs in their island's order (see
// OpSequencer). Applying a run enqueues its work on the devices at once, in that order; each
// device waits for an item's inputs when it reaches it. Nothing else blocks on a computation.
// Thread-safe.
class HostRuntime {
 public:
  explicit HostRuntime(HostRuntimeOptions options);
  ~HostRuntime();

  const std::string& name() const { return options_.name; }
  int num_devices() const { return static_cast<int>(devices_.size()); }
  Device& device(int i) { return *devices_[i]; }
  ObjectStore& store() { return store_; }
  // What the devices compute now and since when (a device stuck in one computation).
  ComputationWatch& computations() { return watch_; }
  // Whether this host can meet other hosts (for collectives and blocks): false without a
  // rendezvous, or when its links could not listen.
  bool has_links() const { return links_ != nullptr; }

  // Compiles `body` for `owner` (FunctionCache::Owner: the client, and the named tenant whose
  // allowance it shares) and returns its key; the function is kept until its clients are
  // collected. FailedPrecondition for a client already collected.
  absl::StatusOr<std::string> Compile(const rpc::FunctionBodyProto& body, const FunctionCache::Owner& owner = {});
  // Takes a batch of one client's ops, applied in the client's sequence order. Errors of
  // individual ops fail the futures of what they produce; malformed ops are returned here (and
  // skipped, keeping their place in the sequence).
  absl::Status Enqueue(const rpc::EnqueueRequest& request);
  // Takes runs from the island scheduler, applied in the order given. They come through the
  // island's control graph, which the controller asks the host to join.
  absl::Status ApplyScheduled(std::vector<rpc::ScheduledOp> ops);
  // Also: the hosts of the newest generation are live, as the controller said when it made it
  // (a host that left and came back at its address takes part in collectives again at once).
  absl::Status JoinControlGraph(const rpc::ControlGraph& graph);
  // Unavailable once the island's order cannot go on here (HostControl::Broken): the host must
  // leave.
  absl::Status ControlBroken() { return control_.Broken(); }
  // Completes once the requested shards are computed and copied into `*response` (once each,
  // from device memory; the caller keeps `response` alive until then).
  Future<Unit> Fetch(const rpc::FetchRequest& request, rpc::FetchResponse* response);
  // The buffers of the requested shards, in the request's order, once the ops that produce them
  // are applied (the data stream writes them to its socket from there, without a copy). The
  // caller has checked the client's credential.
  Future<std::vector<BufferPtr>> FetchBuffers(const rpc::FetchRequest& request);
  // A put's bytes sent ahead over a data stream: LandStaged gives the device buffer they are read
  // into, KeepStaged holds it until the put op naming the same dest is applied (a later staging
  // of the same dest replaces it; the client's collection frees it). The caller has checked the
  // client's credential.
  absl::StatusOr<BufferPtr> LandStaged(const rpc::StageRequest& request);
  absl::Status KeepStaged(const rpc::StageRequest& request, BufferPtr buffer);
  // The client went away (it said goodbye, or its lease lapsed): everything it owns here is
  // freed (buffers that queued work still uses, once that work is done). Runs from the island
  // scheduler's retirement of the client, which also refuses its later ops. Idempotent;
  // returns false if it was already collected.
  bool CollectClient(const std::string& client);
  // The host is going: whatever waits on it (fetches waiting for ops, gangs waiting for members,
  // inputs waiting for blocks) fails now, so the server's calls can end. The destructor does the
  // rest. Idempotent.
  void BeginShutdown();
  // The clients whose buffers, programs or ops this host holds (not those it collected).
  std::vector<std::string> HeldClients();
  // Publishes this host's links (collectives, blocks) where other hosts look them up; called
  // whenever the host registers, since a restarted controller forgot them.
  void PublishLinks();
  // What this host moved and waited for since it started: blocks, dataflow bytes, collectives
  // (heartbeats carry it to the controller's metrics).
  void DescribeCounters(rpc::HostCounters* counters) const;
  // Peers this host's dataflow batches went nowhere to for `limit` or longer
  // (dataflow::GrpcTransport::Stalled).
  std::vector<dataflow::GrpcTransport::PeerBacklog> StalledPeers(absl::Duration limit) const {
    return dataflow_transport_.Stalled(limit);
  }
  // `host` left the cluster: the dataflow batches waiting for it are dropped
  // (dataflow::GrpcTransport::Forget).
  void ForgetPeer(const std::string& host) { dataflow_transport_.Forget(host); }
  // The hosts that left the island, with why (the controller's heartbeat answer): collectives
  // over them fail at once instead of waiting out their timeout (TcpLinks::SetDeparted).
  void SetDepartedPeers(const absl::flat_hash_map<std::string, std::string>& why);
  // What this host's devices ran for the requesting client.
  rpc::GetTraceResponse GetTrace(const rpc::GetTraceRequest& request) const;

  // Fault injection for tests: this host sets up each run op `delay` late, so blocks from other
  // hosts arrive before it expects them.
  void TEST_DelayRunOps(absl::Duration delay) { test_run_delay_us_ = absl::ToInt64Microseconds(delay); }
  // Fault injection for tests: ops that `client` sends straight to this host are applied `delay`
  // late (runs from the scheduler are not delayed, but still wait for the client's earlier ops).
  // They wait on a thread of their own, so the host's other work goes on meanwhile.
  void TEST_DelayOpsFrom(const std::string& client, absl::Duration delay) {
    absl::MutexLock lock(&programs_mu_);
    test_op_delays_[client] = delay;
    if (test_delay_pool_ == nullptr) test_delay_pool_ = std::make_unique<ThreadPool>(options_.name + "-delay", 1);
    test_op_delays_set_.store(true);
  }
  // For tests of a node's block exchange on its own dataflow graph: the receiving operator of
  // program node `program_node`, and the store its blocks land in.
  std::unique_ptr<dataflow::Operator> TEST_MakeBlockReceiver(const std::string& client, int program_node) {
    return MakeBlockReceiver(client, program_node);
  }
  ObjectStore& TEST_store() { return store_; }

 private:
  absl::Status ValidateOp(const rpc::Op& op) const;
  // InvalidArgument naming the device when this host has no device `device`.
  absl::Status CheckDevice(int device) const;
  // FailedPrecondition when `client` was collected here (it went away).
  absl::Status CheckNotCollectedLocked(const std::string& client) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(programs_mu_);
  void ApplyOp(const std::string& client, const rpc::Op& op);
  absl::Status RegisterProgram(const std::string& client, const rpc::ProgramProto& proto);
  absl::Status RunProgram(const std::string& client, const rpc::RunProgramOp& op);

  // A registered program as this host planned it (see core/ids.h). Each RunProgramOp is one
  // epoch of its dataflow graph: a host closes its sending shards once it has handed over every
  // block it owes, so receivers learn when all their blocks are in.
  struct HostProgram {
    std::shared_ptr<const LoweredProgram> lowered;
    std::string client;
    std::vector<NodePlan> nodes;  // per program node
    std::shared_ptr<dataflow::Engine> engine;
    // The runs (epochs) whose dataflow batches were dropped here before the program was
    // registered: they fail at set-up. Set before the program is shared.
    dataflow::LostEpochs lost;
  };
  // The operators of a node's block exchange (block_exchange.cc).
  class BlockReceiver;
  static std::unique_ptr<dataflow::Operator> MakeBlockSender(int edge);
  static std::unique_ptr<dataflow::Operator> MakeArmingSource();
  std::unique_ptr<dataflow::Operator> MakeBlockReceiver(const std::string& client, int program_node);
  // Sends every block that this host holds and another host's shards of `node` need. Returns
  // one future per block, ready once it is handed to the dataflow engine.
  std::vector<Future<Unit>> SendInputs(const std::shared_ptr<HostProgram>& program, int node_index,
                                       const rpc::RunProgramOp& run);
  // Wires one local shard of `node` to its inputs and enqueues it on its device. A node that
  // takes donated buffers starts once `donations_dropped` is ready: the store no longer holds them
  // (the future is unset for runs whose nodes take none).
  struct RunTracker;
  void ExecuteShard(const std::shared_ptr<const HostProgram>& program, int node_index, const ShardPlan& plan,
                    const rpc::RunProgramOp& run, std::shared_ptr<RunTracker> tracker, Future<Unit> donations_dropped);
  // Hands a block to the host that needs it: the buffer itself to a host of this process, over
  // the block streams to any other (from the producer's memory when the region is contiguous),
  // or inline in the dataflow graph when the host has no streams. Ready once the block is in
  // the receiver's object store, or its failure went into the dataflow graph for the receiver.
  Future<Unit> Send(const std::shared_ptr<HostProgram>& program, ObjectStore::ShardKey source, const Region& region,
                    const std::string& dest, const ObjectStore::TransferId& id);
  // A block's header, and its data when it travels inline.
  static rpc::TransferRequest BlockHeader(const std::string& client, const ObjectStore::TransferId& id);
  // Sends an inline block (or a failure) through the node's exchange in the dataflow graph.
  void SendInline(const std::shared_ptr<HostProgram>& program, const ObjectStore::TransferId& id, const std::string& dest,
                  const rpc::TransferRequest& request);
  // The consumer fails with `status` instead of waiting for the block.
  void SendFailure(const std::shared_ptr<HostProgram>& program, const ObjectStore::TransferId& id,
                   const std::string& dest, const absl::Status& status);
  // Where a block from the block streams lands: a staging buffer for the header's spec.
  absl::StatusOr<collective::BlockStreams::Landing> LandBlock(const std::string& from, const std::string& header,
                                                              uint64_t bytes);
  // A host of this process, by name, given a block straight into its object store; false when
  // there is no such host.
  void JoinInProcessDirectory();
  void LeaveInProcessDirectory();
  static bool DeliverInProcess(const std::string& host, const std::string& client, const ObjectStore::TransferId& id,
                               BufferPtr block);
  void ReceiveTransfer(const std::string& client, const rpc::TransferRequest& request);
  // Every block of `node` in the epoch has arrived: fails any this host still waits for, with
  // `why` added when something is known (a block that did not parse).
  void FinishEpoch(const std::string& client, Epoch epoch, int node, const std::string& why);
  void Put(const std::string& client, const rpc::PutOp& op);
  // The bytes staged for `dest`, taken out of staged_; null when none are.
  BufferPtr TakeStaged(const std::string& client, const rpc::ShardRef& dest);

  const HostRuntimeOptions options_;
  // Runs set up here whose shards are not all done (RunTracker); before the devices, whose queued
  // work holds trackers.
  std::atomic<int64_t> runs_in_flight_{0};
  const std::shared_ptr<DcnEmulation> dcn_;  // null unless emulating; links learn islands from programs
  const std::shared_ptr<collective::TcpLinks> links_;  // null without a rendezvous store
  // The hosts of the newest control generation joined: never taken for departed (a heartbeat's
  // answer may be older than the generation).
  absl::Mutex live_mu_;
  std::string live_incarnation_ ABSL_GUARDED_BY(live_mu_);  // of the controller that made it
  int64_t live_generation_ ABSL_GUARDED_BY(live_mu_) = -1;
  absl::flat_hash_set<std::string> live_hosts_ ABSL_GUARDED_BY(live_mu_);
  collective::CollectiveHub collectives_;  // used by device threads; outlives them (see ~HostRuntime)
  ComputationWatch watch_;  // used by device threads; outlives them
  std::vector<std::unique_ptr<Device>> devices_;
  ObjectStore store_;
  std::unique_ptr<collective::BlockStreams> blocks_;  // null without links; lands blocks in store_
  bool in_process_directory_ = false;  // whether other hosts of this process find this one by name
  FunctionCache functions_;
  ThreadPool io_pool_;  // transfers, dataflow work and fetch responses, off device threads
  dataflow::GrpcTransport dataflow_transport_;
  std::unique_ptr<dataflow::DcnTransport> dcn_transport_;  // over dataflow_transport_, when emulating
  dataflow::OwnedEngines engines_;  // every program's, shut down before the host goes
  absl::Mutex programs_mu_;
  absl::flat_hash_map<std::pair<std::string, LoweredProgramId>, std::shared_ptr<HostProgram>> programs_
      ABSL_GUARDED_BY(programs_mu_);
  absl::flat_hash_set<std::string> collected_ ABSL_GUARDED_BY(programs_mu_);  // clients that went away
  std::atomic<int64_t> test_run_delay_us_{0};
  OpSequencer sequencer_;  // it applies ops that use everything above
  // Per client, the last epoch run here: a client's epochs reach a host in increasing order.
  absl::flat_hash_map<std::string, Epoch> last_epoch_ ABSL_GUARDED_BY(programs_mu_);
  // Why programs failed to register, per client and program id (a bounded number per client):
  // their runs fail with that reason.
  absl::flat_hash_map<std::string, std::map<int64_t, absl::Status>> failed_registrations_ ABSL_GUARDED_BY(programs_mu_);
  absl::flat_hash_map<std::string, absl::Duration> test_op_delays_ ABSL_GUARDED_BY(programs_mu_);
  // Staged puts' bytes by client and dest (array id, shard), until their put ops are applied.
  absl::flat_hash_map<std::string, absl::flat_hash_map<std::pair<int64_t, int32_t>, BufferPtr>> staged_
      ABSL_GUARDED_BY(programs_mu_);
  std::atomic<bool> test_op_delays_set_{false};  // keeps the lookup off the path when unused
  std::unique_ptr<ThreadPool> test_delay_pool_ ABSL_GUARDED_BY(programs_mu_);  // where delayed ops wait
  absl::Notification test_delay_stop_;  // the host is going: delayed ops are dropped
  // Shards of runs that failed here, by client label (the first 8 digits of the id), for the
  // metrics: kept after a client goes (counters do not go back), at most kMaxFailureLabels
  // labels, the rest counted under "other".
  static constexpr size_t kMaxFailureLabels = 256;
  void CountShardFailure(const std::string& client);
  mutable absl::Mutex failures_mu_;
  absl::flat_hash_map<std::string, int64_t> failed_shards_ ABSL_GUARDED_BY(failures_mu_);
  HostControl control_;  // last: it hands ops to the sequencer
};

}  // namespace pathways
