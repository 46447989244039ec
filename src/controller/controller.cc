#include "controller/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/collective.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"
#include "transport/schedule_stream.h"
#include "transport/worker_client.h"

namespace pathways {

IslandScheduler& Controller::scheduler(int island) {
  absl::MutexLock lock(&schedulers_mu_);
  auto& slot = schedulers_[island];
  if (slot.scheduler != nullptr) return *slot.scheduler;
  IslandControlOptions control;
  control.island = island;
  control.controller = address_;
  control.controller_incarnation = incarnation_;
  control.transport = dataflow_transport_.get();
  control.service = &dataflow_service_;
  control.executor = &dataflow_pool_;
  control.join = [](const std::string& host, const rpc::ControlGraph& graph) {
    return WorkerClientCache::Global().Get(host)->JoinControlGraph(graph).Then(
        [](const rpc::JoinControlGraphResponse&) { return Unit{}; });
  };
  // Reports come only for runs the scheduler sent, so it exists by then; `slot` (a map node)
  // stays put until Shutdown, after the control graphs' work has run out.
  control.on_done = [&slot](const rpc::RunDone& done) {
    slot.scheduler->Done(done.client_id(), done.epoch(), done.device_us());
  };
  slot.control = std::make_unique<IslandControlPlane>(std::move(control));
  slot.control->SetMembers(MembersOf(island, registry_.LiveHosts(absl::Now())));
  slot.scheduler = std::make_unique<IslandScheduler>(island, options_.scheduler, *slot.control);
  return *slot.scheduler;
}

Future<Unit> Controller::SubmitAcrossIslands(const std::string& client, double weight,
                                             std::vector<std::pair<int, rpc::GangRun>> parts) {
  std::vector<Future<Unit>> accepted;
  if (options_.TEST_unordered_islands) {
    // Each part on its own, every second client reaching the islands last to first, with a
    // pause between the islands that lets another client's run overtake on the second one.
    bool reversed;
    {
      absl::MutexLock lock(&schedulers_mu_);
      auto [it, added] = TEST_client_ranks_.try_emplace(client, static_cast<int>(TEST_client_ranks_.size()));
      reversed = it->second % 2 == 1;
    }
    if (reversed) std::reverse(parts.begin(), parts.end());
    for (auto& [island, part] : parts) {
      if (!accepted.empty()) absl::SleepFor(absl::Milliseconds(1));
      accepted.push_back(scheduler(island).Submit(client, weight, {std::move(part)}));
    }
    return AllDone(accepted);
  }
  auto run = std::make_shared<CrossIslandRun>(cross_island_order_, static_cast<int>(parts.size()));
  for (auto& [island, part] : parts) {
    accepted.push_back(scheduler(island).Submit(client, weight, {std::move(part)}, run));
  }
  return AllDone(accepted);
}

std::vector<IslandControlPlane::Member> Controller::MembersOf(int island,
                                                              const std::vector<ClusterRegistry::LiveHost>& live) {
  std::vector<IslandControlPlane::Member> members;
  for (const auto& h : live) {
    if (h.island == island) members.push_back({h.address, h.incarnation});
  }
  return members;
}

void Controller::UpdateMembers(const std::vector<ClusterRegistry::LiveHost>& live) {
  std::vector<std::pair<int, IslandControlPlane*>> planes;
  {
    absl::MutexLock lock(&schedulers_mu_);
    for (auto& [island, slot] : schedulers_) {
      if (slot.control != nullptr) planes.emplace_back(island, slot.control.get());
    }
  }
  // Planes live as long as the controller serves.
  for (auto& [island, plane] : planes) plane->SetMembers(MembersOf(island, live));
}

// A handler's answer: the value into the response, or the error.
template <typename T>
grpc::Status Answer(absl::StatusOr<T> r, T* response) {
  if (r.ok()) *response = *std::move(r);
  return ToGrpc(r.status());
}

// Every handler starts here: a tenant's call without the token, or a worker's without the
// cluster token, is refused.
// Declares `tenant`, the named tenant the call acts for ("" none), for PW_CHECK_CLIENT: use it as
// a handler's first statement, never inside an unbraced if.
#define PW_CHECK_CALL_TOKEN(context) \
  std::string tenant;                \
  if (absl::Status auth = CheckTenant(*(context), tenant); !auth.ok()) return ToGrpc(auth)
#define PW_CHECK_CLUSTER_TOKEN(context)                                                      \
  if (absl::Status auth = CheckCallToken(*(context), cluster_token_); !auth.ok()) return ToGrpc(auth)
// And a call that acts for a client must carry that client's credential, of a client this
// controller does not refuse.
#define PW_CHECK_CLIENT(request)                                                                   \
  if (absl::Status auth = CheckClient((request)->client_id(), (request)->credential(), tenant); !auth.ok()) \
  return ToGrpc(auth)

// Schedule is served on gRPC's callback API (it waits for hosts, and must not hold a thread
// meanwhile); the rest are quick and synchronous.
class Controller::Service final : public rpc::Controller::WithCallbackMethod_Schedule<rpc::Controller::Service> {
 public:
  Service(Controller& controller, ClusterRegistry& registry, TenantTokens token, std::string cluster_token)
      : controller_(controller),
        registry_(registry),
        token_(std::move(token)),
        cluster_token_(std::move(cluster_token)) {}

  // Answers once the runs reach their hosts: one call in flight per client and island, which is
  // also how a scheduler that holds runs back slows a client down.
  // The same requests over clients' schedule streams (transport/schedule_stream.h), checked the
  // same way.
  StreamListener::Protocol ScheduleProtocol() {
    return {std::string(kScheduleStreamMagic, kStreamMagicBytes), token_, cluster_token_,
            [this](int fd, const StreamListener& listener, const std::string& tenant) {
              // A refused tenant keeps no stream (its client then hears why through gRPC).
              if (!controller_.clients_.CheckTenantNotRefused(tenant, absl::Now()).ok()) return;
              ServeScheduleStream(fd, listener, [this, tenant](const rpc::ScheduleRequest& request) {
                absl::Status auth = controller_.clients_.CheckTenantNotRefused(tenant, absl::Now());
                if (auth.ok()) auth = CheckClient(request.client_id(), request.credential(), tenant);
                if (!auth.ok()) return Future<Unit>::Ready(auth);
                return controller_.admission_->SubmitOrHold(request, tenant);
              });
            }};
  }

  grpc::ServerUnaryReactor* Schedule(grpc::CallbackServerContext* context, const rpc::ScheduleRequest* request,
                                     rpc::ScheduleResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    std::string tenant;
    absl::Status auth = CheckTenant(*context, tenant);
    if (auth.ok()) auth = CheckClient(request->client_id(), request->credential(), tenant);
    if (!auth.ok()) {
      reactor->Finish(ToGrpc(auth));
      return reactor;
    }
    controller_.admission_->SubmitOrHold(*request, tenant).OnReady(
        [reactor](const absl::StatusOr<Unit>& r) { reactor->Finish(ToGrpc(r.status())); });
    return reactor;
  }

  grpc::Status SliceStates(grpc::ServerContext* context, const rpc::SliceStatesRequest* request,
                           rpc::SliceStatesResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    PW_CHECK_CLIENT(request);
    *response = registry_.SliceStates(request->client_id(), absl::Now());
    return grpc::Status::OK;
  }
  grpc::Status RemapSlice(grpc::ServerContext* context, const rpc::RemapSliceRequest* request,
                          rpc::AllocateSliceResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    PW_CHECK_CLIENT(request);
    return Answer(registry_.RemapSlice(*request, absl::Now()), response);
  }

  grpc::Status ClientHeartbeat(grpc::ServerContext* context, const rpc::ClientHeartbeatRequest* request,
                               rpc::ClientHeartbeatResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    PW_CHECK_CLIENT(request);
    if (request->goodbye()) {
      controller_.clients_.Goodbye(request->client_id(), absl::Now());
    } else {
      controller_.clients_.Renew(request->client_id(), absl::Now());
    }
    response->set_interval_ms(std::max<int64_t>(10, absl::ToInt64Milliseconds(controller_.clients_.timeout()) / 4));
    return grpc::Status::OK;
  }

  grpc::Status RendezvousSet(grpc::ServerContext* context, const rpc::RendezvousSetRequest* request,
                             rpc::RendezvousSetResponse*) override {
    PW_CHECK_CLUSTER_TOKEN(context);
    if (request->key().empty()) return ToGrpc(absl::InvalidArgumentError("rendezvous key is empty"));
    return ToGrpc(rendezvous_.Set(request->key(), request->value()));
  }
  // Blocks a server thread while it waits; waits are bounded, and only hosts connecting for
  // collectives wait here.
  grpc::Status RendezvousGet(grpc::ServerContext* context, const rpc::RendezvousGetRequest* request,
                             rpc::RendezvousGetResponse* response) override {
    PW_CHECK_CLUSTER_TOKEN(context);
    const absl::Duration timeout = absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, kMaxRendezvousWaitMs));
    auto value = rendezvous_.Get(request->key(), timeout);
    if (value.ok()) response->set_value(*std::move(value));
    return ToGrpc(value.status());
  }

  grpc::Status RegisterWorker(grpc::ServerContext* context, const rpc::RegisterWorkerRequest* request,
                              rpc::RegisterWorkerResponse* response) override {
    PW_CHECK_CLUSTER_TOKEN(context);
    const absl::Time now = absl::Now();
    // Tenants it refuses, as this controller's last incarnation told it (it restarted): refused
    // here before the host can be scheduled on.
    for (const rpc::TenantRefusal& r : request->refusals()) controller_.clients_.AdoptRefusal(FromProto(r, now), now);
    grpc::Status status = Answer(registry_.RegisterWorker(*request, now), response);
    // Its island's scheduler reaches it from now on.
    if (status.ok()) controller_.UpdateMembers(registry_.LiveHosts(now));
    // Clients it holds that this controller has not heard of (it restarted): each gets a lease
    // from now, which a live client renews and a dead one lets lapse.
    if (status.ok()) {
      for (const std::string& client : request->clients()) {
        controller_.clients_.Adopt(client, now);
        registry_.NoteClientOnHost(client, request->address());
      }
      for (const TenantRefusal& r : controller_.clients_.TenantRefusals(now)) *response->add_refusals() = ToProto(r, now);
    }
    return status;
  }
  grpc::Status Heartbeat(grpc::ServerContext* context, const rpc::HeartbeatRequest* request,
                         rpc::HeartbeatResponse* response) override {
    PW_CHECK_CLUSTER_TOKEN(context);
    const absl::Time now = absl::Now();
    const ClusterRegistry::Beat beat = registry_.Heartbeat(*request, now);
    // The registered process of a host (it holds the cluster token and its incarnation) leaves
    // because a client's computation never ended: that client would take down the next host the
    // same way, so it is refused from now on and retired, which collects what it holds
    // everywhere; so is its tenant, when it has a token of its own (ClientLeases::Refuse).
    if (beat == ClusterRegistry::Beat::kLeft && !request->stuck_client().empty()) {
      const std::string reason = request->leaving().substr(0, ClusterRegistry::kMaxLeaveReason);
      PW_LOG(Warning) << "refusing client " << ClientLabel(request->stuck_client()) << ": " << reason;
      controller_.clients_.Refuse(request->stuck_client(), reason, now);
    }
    // A host that stays but stopped a client's computation past its computation timeout: the
    // same client would hold the next device as long, so it is refused the same way.
    if (beat == ClusterRegistry::Beat::kAlive) {
      for (const rpc::StoppedComputation& stopped : request->stopped()) {
        if (stopped.client().empty()) continue;
        const std::string reason = stopped.reason().substr(0, ClusterRegistry::kMaxLeaveReason);
        PW_LOG(Warning) << "refusing client " << ClientLabel(stopped.client()) << ": " << reason;
        controller_.clients_.Refuse(stopped.client(), reason, now);
      }
    }
    response->set_registered(beat == ClusterRegistry::Beat::kAlive);
    // Clients it came to hold since it registered, perhaps never heard of here (see
    // HeartbeatRequest.clients): each gets a lease, as at registration.
    if (beat == ClusterRegistry::Beat::kAlive) {
      for (const std::string& client : request->clients()) {
        controller_.clients_.Adopt(client, now);
        registry_.NoteClientOnHost(client, request->address());
      }
    }
    // Hosts it could not deliver to: one of the two leaves (ClusterRegistry::ReportUnreachable),
    // and the island goes on without it at the next membership update.
    if (beat == ClusterRegistry::Beat::kAlive && request->unreachable_size() > 0) {
      for (const std::string& left : registry_.ReportUnreachable(*request, now)) {
        PW_LOG(Warning) << "host " << left << " is made to leave: " << request->address() << " named "
                        << request->unreachable_size() << " hosts it could not deliver to";
      }
    }
    // A host that left (or was made to leave just now, as the one cut off) hears why.
    const std::string why_left = registry_.WhyLeft(*request);
    response->set_expired(beat == ClusterRegistry::Beat::kExpired || beat == ClusterRegistry::Beat::kLeft ||
                          !why_left.empty());
    if (response->expired()) response->set_expired_reason(why_left);
    if (beat == ClusterRegistry::Beat::kAlive) {
      for (const TenantRefusal& r : controller_.clients_.TenantRefusals(now)) {
        *response->add_refusals() = ToProto(r, now);
        response->add_refused_tenants(r.tenant);
      }
    }
    for (const ClusterRegistry::Departed& host : registry_.DepartedHosts(now)) {
      response->add_departed_hosts(host.address);
      rpc::DepartedHost* d = response->add_departed();
      d->set_address(host.address);
      d->set_reason(host.why);
    }
    return grpc::Status::OK;
  }
  grpc::Status GetStatus(grpc::ServerContext* context, const rpc::GetStatusRequest* request,
                         rpc::ClusterStatus* response) override {
    PW_CHECK_CALL_TOKEN(context);
    if (request->timeline_ms() < 0) {
      return ToGrpc(absl::InvalidArgumentError(
          absl::StrCat("a status's timeline reaches ", request->timeline_ms(), " ms back: want 0 or more")));
    }
    // Anyone with the cluster's token may ask: clients appear by label.
    *response = controller_.Status(std::min(absl::Milliseconds(request->timeline_ms()), ClusterRegistry::kTimelineKept));
    return grpc::Status::OK;
  }
  grpc::Status AllocateSlice(grpc::ServerContext* context, const rpc::AllocateSliceRequest* request,
                             rpc::AllocateSliceResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    PW_CHECK_CLIENT(request);
    return Answer(registry_.AllocateSlice(*request, absl::Now()), response);
  }

 private:
  absl::Status CheckClient(const std::string& client, const std::string& credential, const std::string& tenant) {
    PW_RETURN_IF_ERROR(CheckClientCredential(client, credential));
    return controller_.clients_.CheckNotRefused(client, tenant);
  }
  // A tenant's call (or a host's) with a token this cluster admits, of a tenant it does not refuse.
  absl::Status CheckTenant(const grpc::ServerContextBase& context, std::string& tenant) {
    PW_ASSIGN_OR_RETURN(tenant, CallTenant(context, token_, cluster_token_));
    return controller_.clients_.CheckTenantNotRefused(tenant, absl::Now());
  }

  static constexpr int64_t kMaxRendezvousWaitMs = 60'000;
  Controller& controller_;
  ClusterRegistry& registry_;
  const TenantTokens token_;
  const std::string cluster_token_;
  collective::InMemoryKeyValueStore rendezvous_;
};


rpc::ClusterStatus Controller::Status(absl::Duration timeline) {
  const absl::Time now = absl::Now();
  rpc::ClusterStatus status = registry_.Status(now);
  if (timeline > absl::ZeroDuration()) *status.mutable_timeline() = registry_.Timeline(now, timeline);
  status.set_live_clients(clients_.Live(now));
  // Read after the map's lock: scheduling (which takes it for every call) never waits for a
  // status page. They stay until Shutdown, which stops the servers first.
  std::vector<std::pair<IslandScheduler*, IslandControlPlane*>> islands;
  {
    absl::MutexLock lock(&schedulers_mu_);
    for (const auto& [island, slot] : schedulers_) islands.emplace_back(slot.scheduler.get(), slot.control.get());
  }
  // Under FIFO runs wait on the devices, not at the scheduler: what the island's hosts hold.
  std::map<int, int64_t> in_flight;
  for (const rpc::HostStatus& h : status.hosts()) {
    if (!h.alive()) continue;
    int64_t& most = in_flight[h.island()];
    most = std::max(most, h.counters().runs_in_flight());
  }
  for (const auto& [scheduler, control] : islands) {
    rpc::SchedulerStatus* s = status.add_schedulers();
    *s = scheduler->Status();
    s->set_rounds(control->rounds());
    s->set_runs_in_flight(in_flight[s->island()]);
  }
  for (rpc::HostStatus& host : *status.mutable_hosts()) {
    for (rpc::DeviceInfo& device : *host.mutable_devices()) {
      for (rpc::ClientTime& t : *device.mutable_client_time()) t.set_client_id(ClientLabel(t.client_id()));
    }
  }
  for (rpc::SliceStatus& slice : *status.mutable_slices()) slice.set_client_id(ClientLabel(slice.client_id()));
  for (rpc::SchedulerStatus& s : *status.mutable_schedulers()) {
    for (rpc::SchedulerClientStatus& c : *s.mutable_clients()) {
      c.set_tenant(clients_.TenantOf(c.client_id()));
      c.set_client_id(ClientLabel(c.client_id()));
    }
  }
  for (const TenantRefusal& r : clients_.TenantRefusals(now)) {
    status.add_refused_tenants(absl::StrCat(r.tenant, ": ", r.reason, " (until ", absl::FormatTime(r.until), ")"));
  }
  return status;
}

Controller::Controller(ControllerOptions options)
    : options_(std::move(options)), registry_(options_.heartbeat_timeout), clients_(options_.client_timeout) {}

Controller::~Controller() { Shutdown(); }

// Departed clients are retired through every island's scheduler: hosts collect them in the
// island's order, after the runs already sent, never in the middle of a gang.
void Controller::RetireLoop() {
  while (!stop_.WaitForNotificationWithTimeout(std::min(options_.client_timeout / 4, absl::Milliseconds(100)))) {
    const absl::Time now = absl::Now();
    // Before anything is judged by silence: a controller that was itself away (frozen, starved)
    // credits hosts and clients with that time.
    registry_.Awake(now);
    clients_.Awake(now);
    const std::vector<ClusterRegistry::LiveHost> live = registry_.LiveHosts(now);
    UpdateMembers(live);  // hosts that stopped heartbeating leave their island's control graph
    admission_->RetryHeld(now);
    for (const std::string& client : clients_.TakeDeparted(now)) {
      std::map<int, std::vector<std::string>> islands;
      for (const auto& h : live) islands[h.island].push_back(h.address);
      PW_LOG(Info) << "client " << client << " went away; retiring it on " << islands.size() << " islands";
      for (const auto& [island, hosts] : islands) scheduler(island).RetireClient(client, hosts);
      registry_.ForgetClient(client);
      admission_->ForgetClient(client);
    }
  }
}

absl::Status Controller::Start() {
  PW_ASSIGN_OR_RETURN(const std::string token, TokenFromFlagOrEnv(options_.token));
  PW_ASSIGN_OR_RETURN(const std::string cluster_token, ClusterTokenFromFlagOrEnv(options_.cluster_token, token));
  PW_ASSIGN_OR_RETURN(const TenantTokens tenants, TenantTokens::Load(token, options_.tenants_file, cluster_token));
  // Hosts of a previous incarnation register again within a heartbeat interval (a quarter of the
  // timeout) once they reconnect, which gRPC retries at least every second (ChannelArgs).
  admission_ = std::make_unique<ScheduleAdmission>(
      registry_, options_.scheduler.max_client_weight, absl::Now() + options_.heartbeat_timeout + absl::Seconds(2),
      ScheduleAdmission::Sinks{
          [this](int island, const std::string& client, double weight, std::vector<rpc::GangRun> runs) {
            return scheduler(island).Submit(client, weight, std::move(runs));
          },
          [this](const std::string& client, double weight, std::vector<std::pair<int, rpc::GangRun>> parts) {
            return SubmitAcrossIslands(client, weight, std::move(parts));
          },
          [this](const std::string& client, const std::string& tenant) {
            PW_RETURN_IF_ERROR(clients_.CheckTenantNotRefused(tenant, absl::Now()));
            return clients_.CheckNotRefused(client, tenant);
          }});
  service_ = std::make_unique<Service>(*this, registry_, tenants, cluster_token);
  grpc::ServerBuilder builder;
  ConfigureServer(builder);
  int port = 0;
  builder.AddListeningPort(options_.listen_address, ServerCredentials(), &port);
  builder.RegisterService(service_.get());
  dataflow_service_.RequireToken(cluster_token);
  dataflow_service_.AnswerStreamPortTo(tenants);  // tenants find their schedule streams
  builder.RegisterService(&dataflow_service_);
  PW_ASSIGN_OR_RETURN(server_, StartServer(builder, "controller", options_.listen_address, &port));
  address_ = absl::StrCat(options_.listen_address.substr(0, options_.listen_address.rfind(':')), ":", port);
  dataflow_transport_ = std::make_unique<dataflow::GrpcTransport>(address_);
  dataflow_service_.ServeInProcess(address_);
  if (PlainControlStreams()) {
    const std::string ip = HostOfAddress(options_.listen_address);
    auto streams = StreamListener::Start("controller stream", ip, options_.stream_port,
                                         {dataflow_service_.StreamProtocol(), service_->ScheduleProtocol()});
    if (!streams.ok() && options_.stream_port != 0) {
      return absl::UnavailableError(absl::StrCat("controller ", address_, " cannot serve its streams on port ",
                                                 options_.stream_port, ": ", streams.status().message()));
    }
    if (streams.ok()) {
      streams_ = *std::move(streams);
      dataflow_service_.SetStreamPort(streams_->port());
    } else {
      PW_LOG(Warning) << "controller " << address_ << ": no stream listener, hosts send dataflow batches and "
                      << "clients schedule through gRPC: "
                      << streams.status();
    }
  }
  retire_thread_ = std::thread([this] {
    NameThisThread("retire-clients");
    RetireLoop();
  });
  if (options_.http_port >= 0) {
    StatusHttpOptions http;
    http.ip = HostOfAddress(options_.listen_address);
    const bool loopback = http.ip == "localhost" || http.ip == "::1" || http.ip.rfind("127.", 0) == 0;
    if (TlsConfigured() && !loopback) {
      // It has no TLS of its own: off loopback the token would cross the network in the clear.
      PW_LOG(Warning) << "with TLS on, the dashboard serves on 127.0.0.1 only (it has no TLS), not on " << http.ip;
      http.ip = "127.0.0.1";
    }
    http.port = options_.http_port;
    http.token = tenants;
    http_ip_ = http.ip;
    PW_ASSIGN_OR_RETURN(http_, StatusHttpServer::Start(std::move(http), [this] { return Status(); }, [this] {
                          return registry_.Timeline(absl::Now(), kDashboardTimeline);
                        }));
  }
  return absl::OkStatus();
}

void Controller::Shutdown() {
  http_.reset();  // its pages read the registry and the schedulers
  if (!stop_.HasBeenNotified()) stop_.Notify();
  // Before the server waits for their calls: new and held requests are refused.
  if (admission_ != nullptr) admission_->Close();
  if (retire_thread_.joinable()) retire_thread_.join();
  {
    // Schedule calls waiting for hosts end now, so the server's shutdown does not wait for them.
    absl::MutexLock lock(&schedulers_mu_);
    for (auto& [island, slot] : schedulers_) {
      if (slot.control != nullptr) slot.control->Stop();
    }
  }
  dataflow_service_.StopServingInProcess();
  streams_.reset();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
  }
  // The control graphs' work runs out before the schedulers and planes it calls go (each
  // island's scheduler before its plane: see Island).
  dataflow_pool_.Shutdown();
  cross_island_order_.Close();  // no run over several islands reaches a scheduler that is gone
  absl::MutexLock lock(&schedulers_mu_);
  schedulers_.clear();
}

}  // namespace pathways
