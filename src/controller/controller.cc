#include "controller/controller.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "collective/collective.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/rpc_util.h"

namespace pathways {

class Controller::Service final : public rpc::Controller::Service {
 public:
  explicit Service(ClusterRegistry& registry) : registry_(registry) {}

  grpc::Status RendezvousSet(grpc::ServerContext*, const rpc::RendezvousSetRequest* request,
                             rpc::RendezvousSetResponse*) override {
    if (request->key().empty()) return ToGrpc(absl::InvalidArgumentError("rendezvous key is empty"));
    return ToGrpc(rendezvous_.Set(request->key(), request->value()));
  }
  // Blocks a server thread while it waits; waits are bounded, and only hosts connecting for
  // collectives wait here.
  grpc::Status RendezvousGet(grpc::ServerContext*, const rpc::RendezvousGetRequest* request,
                             rpc::RendezvousGetResponse* response) override {
    const absl::Duration timeout = absl::Milliseconds(std::clamp<int64_t>(request->timeout_ms(), 0, kMaxRendezvousWaitMs));
    auto value = rendezvous_.Get(request->key(), timeout);
    if (value.ok()) response->set_value(*std::move(value));
    return ToGrpc(value.status());
  }

  grpc::Status RegisterWorker(grpc::ServerContext*, const rpc::RegisterWorkerRequest* request,
                              rpc::RegisterWorkerResponse* response) override {
    auto r = registry_.RegisterWorker(*request, absl::Now());
    if (r.ok()) *response = *r;
    return ToGrpc(r.status());
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const rpc::HeartbeatRequest* request,
                         rpc::HeartbeatResponse* response) override {
    response->set_registered(registry_.Heartbeat(*request, absl::Now()));
    return grpc::Status::OK;
  }
  grpc::Status GetStatus(grpc::ServerContext*, const rpc::GetStatusRequest*,
                         rpc::ClusterStatus* response) override {
    *response = registry_.Status(absl::Now());
    return grpc::Status::OK;
  }
  grpc::Status AllocateSlice(grpc::ServerContext*, const rpc::AllocateSliceRequest* request,
                             rpc::AllocateSliceResponse* response) override {
    auto r = registry_.AllocateSlice(*request, absl::Now());
    if (r.ok()) *response = *r;
    return ToGrpc(r.status());
  }

 private:
  static constexpr int64_t kMaxRendezvousWaitMs = 60'000;
  ClusterRegistry& registry_;
  collective::InMemoryKeyValueStore rendezvous_;
};

Controller::Controller(ControllerOptions options)
    : options_(std::move(options)), registry_(options_.heartbeat_timeout) {}

Controller::~Controller() { Shutdown(); }

absl::Status Controller::Start() {
  service_ = std::make_unique<Service>(registry_);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options_.listen_address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("controller cannot listen on ", options_.listen_address));
  }
  address_ = absl::StrCat(options_.listen_address.substr(0, options_.listen_address.rfind(':')), ":", port);
  return absl::OkStatus();
}

void Controller::Shutdown() {
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_.reset();
  }
}

}  // namespace pathways
