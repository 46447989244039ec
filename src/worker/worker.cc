#include "worker/worker.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "compute/checkpoint_files.h"
#include "compute/text_source.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "dataflow/stream_peer.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"
#include "worker/recent_work.h"

namespace pathways {

namespace {

// Hosts meet at the controller to connect for collectives.
class ControllerRendezvous : public collective::KeyValueStore {
 public:
  explicit ControllerRendezvous(std::string controller) : controller_(std::move(controller)) {}
  absl::Status Set(const std::string& key, std::string value) override { return controller_.RendezvousSet(key, value); }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return controller_.RendezvousGet(key, timeout);
  }

 private:
  ControllerClient controller_;
};

// gRPC message limits sized from what the protocol carries, not a blanket size that any peer
// could make this process buffer: a request holds at most one shard's data (a put through gRPC,
// when the data stream is not used) or one dataflow batch; a response at most this host's shards
// of one array (a fetch).
int MessageLimit(int64_t bytes) {
  return static_cast<int>(std::min<int64_t>(bytes + (int64_t{1} << 20), std::numeric_limits<int>::max()));
}
int ReceiveLimit(const WorkerOptions& o) {
  return MessageLimit(std::max<int64_t>(dataflow::kMaxDataflowFrameBytes, o.device_memory_bytes));
}
int SendLimit(const WorkerOptions& o) {
  const int64_t most = std::numeric_limits<int>::max();
  return MessageLimit(o.device_memory_bytes > most / o.num_devices ? most : o.num_devices * o.device_memory_bytes);
}

}  // namespace

Worker::Worker(WorkerOptions options) : options_(std::move(options)) {}

Worker::~Worker() { Shutdown(); }

absl::Status Worker::Start() {
  if (options_.num_devices <= 0 || options_.num_devices > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--devices must be between 1 and 4096, got ", options_.num_devices));
  }
  if (options_.device_memory_bytes <= 0) {
    return absl::InvalidArgumentError("--device-memory must be positive");
  }
  for (const std::string& dir : options_.data_directories) {
    absl::Status allowed = AllowDataDirectory(dir);
    if (!allowed.ok()) return absl::InvalidArgumentError(absl::StrCat("--data-dir: ", allowed.message()));
  }
  if (!options_.checkpoint_directory.empty()) {
    absl::Status set = SetCheckpointDirectory(options_.checkpoint_directory);
    if (!set.ok()) return absl::InvalidArgumentError(absl::StrCat("--checkpoint-dir: ", set.message()));
  }
  service_ = std::make_unique<WorkerService>();
  PW_ASSIGN_OR_RETURN(const std::string token, TokenFromFlagOrEnv(options_.token));
  PW_ASSIGN_OR_RETURN(const std::string cluster_token, ClusterTokenFromFlagOrEnv(options_.cluster_token, token));
  PW_ASSIGN_OR_RETURN(const TenantTokens tenants, TenantTokens::Load(token, options_.tenants_file, cluster_token));
  service_->RequireTokens(tenants, cluster_token, &refused_tenants_);
  dataflow_service_.RequireToken(cluster_token);
  grpc::ServerBuilder builder;
  ConfigureServer(builder);
  int port = 0;
  builder.AddListeningPort(options_.listen_address, ServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(ReceiveLimit(options_));
  builder.SetMaxSendMessageSize(SendLimit(options_));
  builder.RegisterService(service_.get());
  builder.RegisterService(&dataflow_service_);
  PW_ASSIGN_OR_RETURN(server_, StartServer(builder, "worker", options_.listen_address, &port));
  std::string host = options_.listen_address.substr(0, options_.listen_address.rfind(':'));
  address_ = absl::StrCat(host, ":", port);
  // Hosts that share this process (an embedded cluster) hand each other dataflow batches directly.
  dataflow_service_.ServeInProcess(address_);
  HostRuntimeOptions runtime_options{options_.num_devices, options_.device_memory_bytes, address_,
                                     &dataflow_service_, options_.intra_op_threads};
  runtime_options.rendezvous = std::make_shared<ControllerRendezvous>(options_.controller_address);
  runtime_options.collective_timeout = options_.collective_timeout;
  runtime_options.incarnation = incarnation_;
  runtime_options.memory_wait = options_.memory_wait;
  runtime_options.island = options_.island;
  runtime_options.dcn = options_.dcn;
  runtime_options.cluster_token = cluster_token;
  runtime_options.backend = options_.backend;
  runtime_options.compiled_memory_bytes = options_.compiled_memory_bytes;
  runtime_options.compiled_memory_per_client_bytes = options_.compiled_memory_per_client_bytes;
  runtime_options.links_port = options_.links_port;
  runtime_ = std::make_unique<HostRuntime>(std::move(runtime_options));
  if (options_.links_port != 0 && !runtime_->has_links()) {
    return absl::UnavailableError(absl::StrCat("worker ", address_, " cannot listen for other hosts on port ",
                                               options_.links_port, " (in use, or not an address of this machine)"));
  }
  if (!TlsConfigured()) {
    // Without one (the stream listens on numeric addresses only), clients put and fetch through
    // gRPC.
    HostRuntime* runtime = runtime_.get();
    DataStreamServer::Handlers handlers{
        .fetch = [runtime](const rpc::FetchRequest& request) { return runtime->FetchBuffers(request); },
        .land = [runtime](const rpc::StageRequest& request) { return runtime->LandStaged(request); },
        .keep = [runtime](const rpc::StageRequest& request, BufferPtr buffer) {
          return runtime->KeepStaged(request, std::move(buffer));
        },
        .enqueue = [runtime](const rpc::EnqueueRequest& request) { return runtime->Enqueue(request); },
        .refused = [this](const std::string& tenant) { return refused_tenants_.Check(tenant, absl::Now()); }};
    // The same port takes other hosts' (and the controller's) dataflow batches.
    std::vector<StreamListener::Protocol> more;
    if (PlainControlStreams()) more.push_back(dataflow_service_.StreamProtocol());
    auto stream = DataStreamServer::Start(host, tenants, cluster_token, std::move(handlers), {}, options_.data_port,
                                          DataStreamServer::kMaxConnections, std::move(more));
    if (!stream.ok() && options_.data_port != 0) {
      return absl::UnavailableError(absl::StrCat("worker ", address_, " cannot serve its data stream on port ",
                                                 options_.data_port, ": ", stream.status().message()));
    }
    if (stream.ok()) {
      data_stream_ = *std::move(stream);
      service_->SetDataPort(data_stream_->port());
      if (PlainControlStreams()) dataflow_service_.SetStreamPort(data_stream_->port());
    } else {
      PW_LOG(Warning) << "worker " << address_ << ": no data stream, clients put and fetch (and hosts send "
                      << "dataflow batches) through gRPC: "
                      << stream.status();
    }
  }
  service_->AttachRuntime(runtime_.get());
  controller_ = std::make_unique<ControllerClient>(options_.controller_address);
  absl::Time deadline = absl::Now() + options_.register_timeout;
  absl::Status registered;
  while (!(registered = Register()).ok()) {
    // A refusal is final (a wrong token, a bad request); waiting only helps a controller that is
    // not up yet.
    if (absl::IsUnauthenticated(registered) || absl::IsInvalidArgument(registered) ||
        absl::IsPermissionDenied(registered)) {
      return absl::Status(registered.code(), absl::StrCat("controller ", options_.controller_address,
                                                          " refused to register this worker: ", registered.message()));
    }
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat("worker could not register with controller ",
                                                 options_.controller_address, ": ",
                                                 registered.message()));
    }
    if (stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      return absl::CancelledError("worker shut down while registering");
    }
  }
  heartbeat_thread_ = std::thread([this] {
    NameThisThread("heartbeat");
    HeartbeatLoop();
  });
  return absl::OkStatus();
}

void Worker::DescribeDevices(google::protobuf::RepeatedPtrField<rpc::DeviceInfo>* devices, bool recent_work) {
  if (recent_work) work_reported_until_us_.resize(runtime_->num_devices(), 0);
  for (int i = 0; i < runtime_->num_devices(); ++i) {
    DeviceStats s = runtime_->device(i).stats();
    rpc::DeviceInfo* d = devices->Add();
    d->set_local_index(i);
    d->set_kind(runtime_->device(i).kind());
    d->set_memory_capacity(s.memory_capacity);
    d->set_memory_used(s.memory_used);
    d->set_memory_peak(s.memory_peak);
    d->set_executed(s.executed);
    d->set_busy_micros(s.busy_micros);
    for (const auto& [client, micros] : s.busy_micros_by_client) {
      rpc::ClientTime* t = d->add_client_time();
      t->set_client_id(client);
      t->set_busy_micros(micros);
    }
    if (recent_work) {
      int64_t& until = work_reported_until_us_[i];
      const std::vector<TraceEvent> events = runtime_->device(i).Trace(until);
      for (rpc::WorkBucket& bucket : RecentWork(events, until)) *d->add_recent_work() = std::move(bucket);
      for (const TraceEvent& e : events) until = std::max(until, e.end_us);
    }
  }
}

rpc::RegisterWorkerRequest Worker::RegistrationRequest() {
  rpc::RegisterWorkerRequest request;
  request.set_address(address_);
  request.set_island(options_.island);
  request.set_incarnation(incarnation_);
  for (std::string& client : runtime_->HeldClients()) request.add_clients(std::move(client));
  const absl::Time now = absl::Now();
  for (const TenantRefusal& r : refused_tenants_.InForce(now)) *request.add_refusals() = ToProto(r, now);
  DescribeDevices(request.mutable_devices());
  return request;
}

void Worker::SetRefusals(const google::protobuf::RepeatedPtrField<rpc::TenantRefusal>& refusals,
                         const google::protobuf::RepeatedPtrField<std::string>& names) {
  const absl::Time now = absl::Now();
  std::vector<TenantRefusal> in_force;
  for (const rpc::TenantRefusal& r : refusals) in_force.push_back(FromProto(r, now));
  // A controller of an earlier version names them only: refused until its next answer says.
  if (refusals.empty()) {
    for (const std::string& name : names) {
      in_force.push_back({name, "the controller says why (`pathways status`)", now + absl::Minutes(1)});
    }
  }
  refused_tenants_.Set(std::move(in_force), now);
}

absl::Status Worker::Register() {
  rpc::RegisterWorkerRequest request = RegistrationRequest();
  auto response = controller_->RegisterWorker(request);
  if (!response.ok()) return response.status();
  named_clients_ = {request.clients().begin(), request.clients().end()};
  SetRefusals(response->refusals(), {});
  host_id_ = response->host_id();
  runtime_->PublishLinks();  // into this controller's rendezvous store (a restarted one forgot them)
  heartbeat_ms_ = std::max<int64_t>(10, response->heartbeat_interval_ms());
  PW_LOG(Info) << "worker " << address_ << " registered as host " << host_id_.load()
               << " in island " << options_.island;
  return absl::OkStatus();
}

absl::Status Worker::StopOverruns(rpc::HeartbeatRequest& request) {
  const absl::Duration limit = options_.computation_timeout;
  if (limit <= absl::ZeroDuration() || limit == absl::InfiniteDuration()) return absl::OkStatus();
  ComputationWatch& watch = runtime_->computations();
  const absl::Time now = absl::Now();
  auto why = [&](const ComputationWatch::Overrun& o) { return DescribeStop(address_, o, limit); };
  for (const ComputationWatch::Overrun& o : watch.StopLongerThan(limit, now, why)) {
    rpc::StoppedComputation& stopped = unreported_stops_.emplace_back();
    stopped.set_client(o.label.client);
    stopped.set_reason(why(o));
    PW_LOG(Warning) << stopped.reason();
  }
  for (const rpc::StoppedComputation& stopped : unreported_stops_) *request.add_stopped() = stopped;
  // A stopped body ends at its loop's next turn, or once the collective or memory wait it is in
  // times out; one still running after that is in a kernel that does not poll.
  const absl::Duration grace = options_.collective_timeout + options_.memory_wait + absl::Seconds(1);
  std::optional<ComputationWatch::Overrun> stuck = watch.NotStopped(grace, now);
  if (!stuck.has_value()) return absl::OkStatus();
  request.set_stuck_client(stuck->label.client);
  return absl::UnavailableError(DescribeOverrun(address_, *stuck, limit, grace));
}

void Worker::NameStalledPeers(rpc::HeartbeatRequest& request) {
  const absl::Duration limit = options_.peer_stall_timeout;
  if (limit <= absl::ZeroDuration() || limit == absl::InfiniteDuration()) return;
  absl::flat_hash_set<std::string> now;
  for (const dataflow::GrpcTransport::PeerBacklog& p : runtime_->StalledPeers(limit)) {
    if (departed_.contains(p.host)) continue;
    now.insert(p.host);
    if (!stalled_peers_.contains(p.host)) continue;
    PW_LOG(Warning) << "dataflow batches for " << p.host << " went nowhere for " << absl::FormatDuration(p.stalled)
                    << " (" << p.bytes << " bytes wait" << (p.refused ? "; some were refused" : "")
                    << "): named to the controller";
    rpc::UnreachablePeer* u = request.add_unreachable();
    u->set_address(p.host);
    u->set_stalled_ms(absl::ToInt64Milliseconds(p.stalled));
    u->set_bytes(p.bytes);
    u->set_refused(p.refused);
  }
  stalled_peers_ = std::move(now);
}

void Worker::HeartbeatLoop() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(heartbeat_ms_.load()))) {
    rpc::HeartbeatRequest request;
    request.set_host_id(host_id_);
    request.set_address(address_);
    request.set_incarnation(incarnation_);
    DescribeDevices(request.mutable_devices(), /*recent_work=*/true);
    runtime_->DescribeCounters(request.mutable_counters());
    std::vector<std::string> held = runtime_->HeldClients();
    for (const std::string& client : held) {
      if (!named_clients_.contains(client)) request.add_clients(client);
    }
    NameStalledPeers(request);
    // Liveness on progress, not only on heartbeats: the process answers, but a device that makes
    // none holds every later gang of its island on this host. The controller hears why at once
    // (not after its heartbeat timeout), and the worker leaves.
    // So does a host whose place in the island's order is lost (its later runs would wait for
    // good).
    absl::Status leaving = runtime_->ControlBroken();
    if (absl::Status stuck = StopOverruns(request); !stuck.ok()) {
      leaving = stuck;
      PW_LOG(Error) << leaving.message();
      stuck_ = true;
    }
    if (!leaving.ok()) {
      request.set_leaving(std::string(leaving.message()));
      if (auto told = controller_->Heartbeat(request); !told.ok()) {
        PW_LOG(Warning) << "the controller was not told (it declares this host dead once its heartbeats stop): "
                        << told.status();
      }
      if (options_.on_left) options_.on_left(leaving);
      return;
    }
    auto response = controller_->Heartbeat(request);
    if (!response.ok()) {
      PW_LOG(Warning) << "heartbeat to " << controller_->address() << " failed: " << response.status();
      continue;
    }
    if (response->registered()) unreported_stops_.clear();
    if (response->expired()) {
      const std::string why = response->expired_reason().empty()
                                  ? "was silent longer than the controller's heartbeat timeout (frozen, cut off or "
                                    "far too slow)"
                                  : absl::StrCat("was made to leave: ", response->expired_reason());
      const absl::Status left = absl::UnavailableError(
          absl::StrCat("worker ", address_, " ", why,
                       ", so the cluster went on without it; it leaves, and a new process at this address "
                       "rejoins as a new worker"));
      PW_LOG(Error) << left.message();
      if (options_.on_left) options_.on_left(left);
      return;
    }
    if (!response->registered()) {
      absl::Status s = Register();  // the controller restarted; names every client it holds
      if (!s.ok()) PW_LOG(Warning) << "re-registration failed: " << s;
    } else {
      named_clients_ = {held.begin(), held.end()};  // those it no longer holds are forgotten too
    }
    // What a controller that knows this host refuses (one that restarted learns it back as the
    // host registers again, so a host that it does not know keeps its own).
    if (response->registered()) SetRefusals(response->refusals(), response->refused_tenants());
    absl::flat_hash_map<std::string, std::string> why;  // empty reasons from a controller of an earlier version
    for (const std::string& host : response->departed_hosts()) why[host];
    for (const rpc::DepartedHost& host : response->departed()) why[host.address()] = host.reason();
    if (response->registered()) {  // a controller that restarted knows of no departures yet
      departed_.clear();
      for (const auto& [host, reason] : why) {
        // What waits for a host that left would wait for good (a new worker at its address starts
        // afresh). At every beat: a run still in flight may have sent to it since the last.
        runtime_->ForgetPeer(host);
        departed_.insert(host);
      }
    }
    // Queued gang runs over a host that left would each hold this host's devices until the
    // collective timeout, waiting for it to connect.
    if (response->registered()) runtime_->SetDepartedPeers(why);
    if (int failed = runtime_->store().SetDepartedHosts(std::move(why)); failed > 0) {
      PW_LOG(Warning) << failed << " blocks from hosts that left will not come; their runs fail";
    }
  }
}

void Worker::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  dataflow_service_.StopServingInProcess();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  // Calls that wait on the runtime (fetches) must end before the server can.
  if (runtime_ != nullptr) runtime_->BeginShutdown();
  data_stream_.reset();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
  }
}

}  // namespace pathways
