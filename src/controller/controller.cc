#include "controller/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "collective/collective.h"
#include "core/logging.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"
#include "transport/worker_client.h"

namespace pathways {

// The schedulers' ops to hosts: one ordered, batched queue per host over gRPC.
class Controller::HostQueues : public ScheduledOpSink {
 public:
  Future<Unit> Push(const std::string& host, rpc::ScheduledOp op) override {
    std::shared_ptr<OrderedBatchQueue<rpc::ScheduledOp>> queue;
    {
      absl::MutexLock lock(&mu_);
      auto& slot = queues_[host];
      if (slot == nullptr) {
        slot = std::make_shared<OrderedBatchQueue<rpc::ScheduledOp>>(
            [worker = WorkerClientCache::Global().Get(host)](std::vector<rpc::ScheduledOp> ops) {
              rpc::ScheduledBatch batch;
              for (rpc::ScheduledOp& op : ops) *batch.add_ops() = std::move(op);
              return worker->ApplyScheduled(batch).Then([](const rpc::ScheduledResponse&) { return Unit{}; });
            },
            // A batch a host did not take (it died, say) fails its runs, whose clients hear it;
            // the queue goes on, so the host is served again if it comes back.
            [host](std::vector<rpc::ScheduledOp> ops, const absl::Status& status) {
              PW_LOG(Warning) << ops.size() << " scheduled runs not delivered to " << host << ": " << status;
            });
      }
      queue = slot;
    }
    queue->Push(std::move(op));
    return queue->Flushed();
  }

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<OrderedBatchQueue<rpc::ScheduledOp>>> queues_ ABSL_GUARDED_BY(mu_);
};

IslandScheduler& Controller::scheduler(int island) {
  absl::MutexLock lock(&schedulers_mu_);
  auto& slot = schedulers_[island];
  if (slot == nullptr) slot = std::make_unique<IslandScheduler>(island, options_.scheduler, *host_queues_);
  return *slot;
}

// A handler's answer: the value into the response, or the error.
template <typename T>
grpc::Status Answer(absl::StatusOr<T> r, T* response) {
  if (r.ok()) *response = *std::move(r);
  return ToGrpc(r.status());
}

// Every handler starts here: a call without the cluster's token is refused.
#define PW_CHECK_CALL_TOKEN(context)                                                     \
  if (absl::Status auth = CheckCallToken(*(context), token_); !auth.ok()) return ToGrpc(auth)

class Controller::Service final : public rpc::Controller::Service {
 public:
  Service(Controller& controller, ClusterRegistry& registry, std::string token)
      : controller_(controller), registry_(registry), token_(std::move(token)) {}

  // Holds a server thread until the runs reach their hosts: one call in flight per client and
  // island, which is also how a scheduler that holds runs back slows a client down.
  grpc::Status Schedule(grpc::ServerContext* context, const rpc::ScheduleRequest* request, rpc::ScheduleResponse*) override {
    PW_CHECK_CALL_TOKEN(context);
    if (request->client_id().empty()) return ToGrpc(absl::InvalidArgumentError("schedule request has no client id"));
    if (!(request->weight() >= 0) || request->weight() > 1e6) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat("scheduling weight ", request->weight(), " is not in [0, 1e6]")));
    }
    const absl::Time now = absl::Now();
    std::map<int, std::vector<rpc::GangRun>> by_island;
    // A batch's runs name the same few hosts over and over: look each up once.
    absl::flat_hash_map<std::string, absl::StatusOr<int32_t>> island_of;
    for (const rpc::GangRun& run : request->runs()) {
      if (run.hosts().empty()) return ToGrpc(absl::InvalidArgumentError("a scheduled run names no hosts"));
      for (const rpc::HostSeq& h : run.hosts()) {
        auto [it, is_new] = island_of.try_emplace(h.host(), 0);
        if (is_new) it->second = registry_.IslandOf(h.host(), now);
        const absl::StatusOr<int32_t>& island = it->second;
        if (!island.ok()) return ToGrpc(island.status());
        if (*island != run.island()) {
          return ToGrpc(absl::InvalidArgumentError(
              absl::StrCat("host ", h.host(), " is in island ", *island, ", not ", run.island())));
        }
      }
      by_island[run.island()].push_back(run);
    }
    std::vector<Future<Unit>> accepted;
    for (auto& [island, runs] : by_island) {
      accepted.push_back(controller_.scheduler(island).Submit(request->client_id(), request->weight(), std::move(runs)));
    }
    return ToGrpc(AllDone(accepted).Await().status());
  }

  grpc::Status SliceStates(grpc::ServerContext* context, const rpc::SliceStatesRequest* request,
                           rpc::SliceStatesResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    *response = registry_.SliceStates(request->client_id(), absl::Now());
    return grpc::Status::OK;
  }
  grpc::Status RemapSlice(grpc::ServerContext* context, const rpc::RemapSliceRequest* request,
                          rpc::AllocateSliceResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    return Answer(registry_.RemapSlice(*request, absl::Now()), response);
  }

  grpc::Status ClientHeartbeat(grpc::ServerContext* context, const rpc::ClientHeartbeatRequest* request,
                               rpc::ClientHeartbeatResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    if (request->client_id().empty()) return ToGrpc(absl::InvalidArgumentError("client heartbeat has no client id"));
    if (request->goodbye()) {
      controller_.clients_.Goodbye(request->client_id(), absl::Now());
    } else {
      controller_.clients_.Renew(request->client_id(), absl::Now());
    }
    response->set_interval_ms(std::max<int64_t>(10, absl::ToInt64Milliseconds(controller_.clients_.timeout()) / 4));
    return grpc::Status::OK;
  }

  grpc::Status RunsDone(grpc::ServerContext* context, const rpc::RunsDoneRequest* request, rpc::RunsDoneResponse*) override {
    PW_CHECK_CALL_TOKEN(context);
    for (const rpc::RunDone& done : request->runs()) {
      controller_.scheduler(done.island()).Done(done.client_id(), done.epoch(), done.device_us());
    }
    return grpc::Status::OK;
  }

  grpc::Status RendezvousSet(grpc::ServerContext* context, const rpc::RendezvousSetRequest* request,
                             rpc::RendezvousSetResponse*) override {
    PW_CHECK_CALL_TOKEN(context);
    if (request->key().empty()) return ToGrpc(absl::InvalidArgumentError("rendezvous key is empty"));
    return ToGrpc(rendezvous_.Set(request->key(), request->value()));
  }
  // Blocks a server thread while it waits; waits are bounded, and only hosts connecting for
  // collectives wait here.
  grpc::Status RendezvousGet(grpc::ServerContext* context, const rpc::RendezvousGetRequest* request,
                             rpc::RendezvousGetResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    const absl::Duration timeout = absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, kMaxRendezvousWaitMs));
    auto value = rendezvous_.Get(request->key(), timeout);
    if (value.ok()) response->set_value(*std::move(value));
    return ToGrpc(value.status());
  }

  grpc::Status RegisterWorker(grpc::ServerContext* context, const rpc::RegisterWorkerRequest* request,
                              rpc::RegisterWorkerResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    return Answer(registry_.RegisterWorker(*request, absl::Now()), response);
  }
  grpc::Status Heartbeat(grpc::ServerContext* context, const rpc::HeartbeatRequest* request,
                         rpc::HeartbeatResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    const absl::Time now = absl::Now();
    response->set_registered(registry_.Heartbeat(*request, now));
    for (const std::string& host : registry_.DepartedHosts(now)) response->add_departed_hosts(host);
    return grpc::Status::OK;
  }
  grpc::Status GetStatus(grpc::ServerContext* context, const rpc::GetStatusRequest*,
                         rpc::ClusterStatus* response) override {
    PW_CHECK_CALL_TOKEN(context);
    *response = registry_.Status(absl::Now());
    return grpc::Status::OK;
  }
  grpc::Status AllocateSlice(grpc::ServerContext* context, const rpc::AllocateSliceRequest* request,
                             rpc::AllocateSliceResponse* response) override {
    PW_CHECK_CALL_TOKEN(context);
    return Answer(registry_.AllocateSlice(*request, absl::Now()), response);
  }

 private:
  static constexpr int64_t kMaxRendezvousWaitMs = 60'000;
  Controller& controller_;
  ClusterRegistry& registry_;
  const std::string token_;
  collective::InMemoryKeyValueStore rendezvous_;
};

Controller::Controller(ControllerOptions options)
    : options_(std::move(options)),
      registry_(options_.heartbeat_timeout),
      clients_(options_.client_timeout),
      host_queues_(std::make_unique<HostQueues>()) {}

Controller::~Controller() { Shutdown(); }

// Departed clients are retired through every island's scheduler: hosts collect them in the
// island's order, after the runs already sent, never in the middle of a gang.
void Controller::RetireLoop() {
  while (!stop_.WaitForNotificationWithTimeout(std::min(options_.client_timeout / 4, absl::Milliseconds(100)))) {
    const absl::Time now = absl::Now();
    for (const std::string& client : clients_.TakeDeparted(now)) {
      std::map<int, std::vector<std::string>> islands;
      const rpc::ClusterStatus status = registry_.Status(now);
      for (const auto& h : status.hosts()) {
        if (h.alive()) islands[h.island()].push_back(h.address());
      }
      PW_LOG(Info) << "client " << client << " went away; retiring it on " << islands.size() << " islands";
      for (const auto& [island, hosts] : islands) scheduler(island).RetireClient(client, hosts);
    }
  }
}

absl::Status Controller::Start() {
  service_ = std::make_unique<Service>(*this, registry_, TokenFromFlagOrEnv(options_.token));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options_.listen_address, ServerCredentials(), &port);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("controller cannot listen on ", options_.listen_address));
  }
  address_ = absl::StrCat(options_.listen_address.substr(0, options_.listen_address.rfind(':')), ":", port);
  retire_thread_ = std::thread([this] { RetireLoop(); });
  return absl::OkStatus();
}

void Controller::Shutdown() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (retire_thread_.joinable()) retire_thread_.join();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
  }
}

}  // namespace pathways
