#include "ops/status_http_server.h"

#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "ops/assets.h"
#include "ops/metrics.h"
#include "transport/auth.h"

namespace pathways {

namespace {

// cpp-httplib's own pool queues every accepted connection without bound. This one has a bound:
// once it is full the accepting thread waits, so further connections wait in the kernel's
// backlog (and beyond it are refused) instead of holding descriptors here.
class BoundedPool : public httplib::TaskQueue {
 public:
  BoundedPool(int threads, int max_queued) : max_queued_(static_cast<size_t>(max_queued)) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~BoundedPool() override = default;  // shutdown() joined the threads

  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    space_.wait(lock, [this] { return stopping_ || tasks_.size() < max_queued_; });
    // After shutdown the connection is still served: dropping it would leak its descriptor.
    tasks_.push_back(std::move(fn));
    work_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_.notify_all();
    space_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

 private:
  void Work() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, and nothing left to serve
        fn = std::move(tasks_.front());
        tasks_.pop_front();
      }
      space_.notify_one();
      fn();
    }
  }

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable work_, space_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which lets a second server
// listen on a port a running one holds.
void ExclusiveSocketOptions(int fd) {
  int yes = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

std::string BearerToken(const httplib::Request& req) {
  const std::string header = req.get_header_value("Authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (header.size() > kBearer.size() && header.compare(0, kBearer.size(), kBearer) == 0) {
    return header.substr(kBearer.size());
  }
  return req.has_param("token") ? req.get_param_value("token") : "";
}

}  // namespace

std::string StatusJson(const rpc::ClusterStatus& status) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(status, &json, options).ok()) return "{}";
  return json;
}

absl::StatusOr<std::unique_ptr<StatusHttpServer>> StatusHttpServer::Start(StatusHttpOptions options, StatusFn status) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("HTTP port ", options.port, " is not in 0..65535"));
  }
  if (options.threads < 1 || options.max_queued_connections < 1 || options.timeout_seconds < 1) {
    return absl::InvalidArgumentError("the HTTP server needs at least one thread, one queued connection and a timeout");
  }
  auto server = std::make_unique<httplib::Server>();
  const int threads = options.threads, queued = options.max_queued_connections;
  server->new_task_queue = [threads, queued] { return new BoundedPool(threads, queued); };
  server->set_socket_options(ExclusiveSocketOptions);
  server->set_read_timeout(options.timeout_seconds, 0);
  server->set_write_timeout(options.timeout_seconds, 0);
  server->set_keep_alive_timeout(options.timeout_seconds);
  server->set_keep_alive_max_count(100);
  server->set_payload_max_length(64 << 10);  // only GETs are served

  const std::string token = options.token;
  server->set_pre_routing_handler([token](const httplib::Request& req, httplib::Response& res) {
    absl::Status auth = CheckToken(BearerToken(req), token);
    if (auth.ok()) return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    res.set_content(absl::StrCat(auth.message(), "\n"), "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
  for (const Asset& asset : Assets()) {
    const std::string path = asset.name == "index.html" ? "/" : "/" + std::string(asset.name);
    server->Get(path, [asset](const httplib::Request&, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_content(std::string(asset.data), std::string(asset.content_type).c_str());
    });
  }
  server->Get("/api/status", [status](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(StatusJson(status()), "application/json");
  });
  server->Get("/metrics", [status](const httplib::Request&, httplib::Response& res) {
    res.set_content(PrometheusText(status()), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) res.set_content(absl::StrCat("HTTP ", res.status, "\n"), "text/plain");
  });
  server->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    res.status = 500;
    res.set_content("internal error\n", "text/plain");
  });

  int port = options.port;
  if (port == 0) {
    port = server->bind_to_any_port(options.ip);
    if (port <= 0) return absl::UnavailableError(absl::StrCat("HTTP server: no free port on ", options.ip));
  } else if (!server->bind_to_port(options.ip, port)) {
    return absl::UnavailableError(absl::StrCat("HTTP server: cannot listen on ", options.ip, ":", port,
                                               " (in use, or not an address of this machine)"));
  }
  std::unique_ptr<StatusHttpServer> self(new StatusHttpServer(std::move(server), port));
  self->thread_ = std::thread([s = self->server_.get()] { s->listen_after_bind(); });
  // stop() only stops a server that is running: wait for that, so the destructor never waits for
  // a listener that started after it.
  for (int i = 0; i < 5000 && !self->server_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  PW_LOG(Info) << "dashboard and metrics at http://" << options.ip << ":" << port << "/";
  return self;
}

StatusHttpServer::StatusHttpServer(std::unique_ptr<httplib::Server> server, int port)
    : server_(std::move(server)), port_(port) {}

StatusHttpServer::~StatusHttpServer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace pathways
