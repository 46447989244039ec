#include "controller/controller.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/rpc_util.h"

namespace pathways {

class Controller::Service final : public rpc::Controller::Service {
 public:
  explicit Service(ClusterRegistry& registry) : registry_(registry) {}

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
  ClusterRegistry& registry_;
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
