#include "ops/status_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cctype>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
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

  // Called by the accepting thread only, which also calls shutdown() once it stops accepting.
  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    space_.wait(lock, [this] { return tasks_.size() < max_queued_; });
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

// SO_REUSEADDR: cpp-httplib's default sets SO_REUSEPORT instead, which lets a second server
// listen on a port a running one holds.
void ExclusiveSocketOptions(int fd) {
  int yes = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

// A route's pattern (cpp-httplib takes regular expressions) matching exactly `path`.
std::string ExactRoute(const std::string& path) {
  std::string pattern;
  for (char c : path) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '/' && c != '_' && c != '-') pattern += '\\';
    pattern += c;
  }
  return pattern;
}

// Whether a request's Host names this server by address (an IP literal or localhost, with or
// without a port) rather than by a DNS name. A page on another site that rebinds its name to
// 127.0.0.1 sends its own name: without a token, that is all that tells it from the operator.
bool HostIsAnAddress(std::string host) {
  if (!host.empty() && host.front() == '[') {  // [v6]:port
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    in6_addr v6;
    return inet_pton(AF_INET6, host.substr(1, close - 1).c_str(), &v6) == 1;
  }
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos) host.resize(colon);
  for (char& c : host) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  in_addr v4;
  return host == "localhost" || inet_pton(AF_INET, host.c_str(), &v4) == 1;
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

// The status callback, until the server is torn down: a thread still serving a slow client after
// that (see ~StatusHttpServer) answers 503 instead of reading a controller that is gone.
class StatusGuard {
 public:
  StatusGuard(StatusHttpServer::StatusFn status, StatusHttpServer::TimelineFn timeline)
      : status_(std::move(status)), timeline_(std::move(timeline)) {}
  std::optional<rpc::ClusterStatus> Read() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status_) return std::nullopt;
    return status_();
  }
  std::optional<rpc::ClusterTimeline> ReadTimeline() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!timeline_) return std::nullopt;
    return timeline_();
  }
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);  // waits for a read in progress
    status_ = nullptr;
    timeline_ = nullptr;
  }

 private:
  std::mutex mu_;
  StatusHttpServer::StatusFn status_;
  StatusHttpServer::TimelineFn timeline_;
};

namespace {
std::string Json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(message, &json, options).ok()) return "{}";
  return json;
}
}  // namespace

std::string StatusJson(const rpc::ClusterStatus& status) { return Json(status); }

absl::StatusOr<std::unique_ptr<StatusHttpServer>> StatusHttpServer::Start(StatusHttpOptions options, StatusFn status,
                                                                          TimelineFn timeline) {
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
  // A dashboard polls every second: a kept connection would hold one of the few threads.
  server->set_keep_alive_max_count(2);
  server->set_payload_max_length(64 << 10);

  const std::string token = options.token;
  // A server on loopback is what a page rebinding its name reaches through the operator's browser;
  // one on another address is reached by name legitimately (a Kubernetes Service, Prometheus).
  in_addr v4;
  const bool on_loopback = options.ip == "::1" || options.ip == "[::1]" || options.ip == "localhost" ||
                           (inet_pton(AF_INET, options.ip.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127);
  const bool by_address_only = token.empty() && on_loopback;
  server->set_pre_routing_handler([token, by_address_only](const httplib::Request& req, httplib::Response& res) {
    // Before any body is read (cpp-httplib reads a chunked one whatever its payload limit): only
    // GETs without a body are served.
    if ((req.method != "GET" && req.method != "HEAD") || req.has_header("Transfer-Encoding") ||
        (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0")) {
      res.status = 405;
      res.set_header("Allow", "GET, HEAD");
      res.set_content("only GET is served here\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (by_address_only && req.has_header("Host") && !HostIsAnAddress(req.get_header_value("Host"))) {
      res.status = 403;
      res.set_content("without a token, this server on loopback answers only requests to its address (an IP "
                      "address or localhost), not to a host name (DNS rebinding); give the controller a token to "
                      "use one\n",
                      "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    absl::Status auth = CheckToken(BearerToken(req), token);
    if (auth.ok()) return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    res.set_content(absl::StrCat(auth.message(), "\n"), "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
  for (const Asset& asset : Assets()) {
    const std::string path = asset.name == "index.html" ? "/" : "/" + std::string(asset.name);
    server->Get(ExactRoute(path), [asset](const httplib::Request&, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_content(asset.data.data(), asset.data.size(), std::string(asset.content_type).c_str());
    });
  }
  const bool has_timeline = timeline != nullptr;
  auto guard = std::make_shared<StatusGuard>(std::move(status), std::move(timeline));
  auto unavailable = [](httplib::Response& res) {
    res.status = 503;
    res.set_content("the controller is shutting down\n", "text/plain");
  };
  server->Get(ExactRoute("/api/status"), [guard, unavailable](const httplib::Request&, httplib::Response& res) {
    auto s = guard->Read();
    if (!s) return unavailable(res);
    res.set_header("Cache-Control", "no-store");
    res.set_content(StatusJson(*s), "application/json");
  });
  if (has_timeline) {
    server->Get(ExactRoute("/api/timeline"), [guard, unavailable](const httplib::Request&, httplib::Response& res) {
      auto t = guard->ReadTimeline();
      if (!t) return unavailable(res);
      res.set_header("Cache-Control", "no-store");
      res.set_content(Json(*t), "application/json");
    });
  }
  server->Get(ExactRoute("/metrics"), [guard, unavailable](const httplib::Request&, httplib::Response& res) {
    auto s = guard->Read();
    if (!s) return unavailable(res);
    res.set_content(PrometheusText(*s), "text/plain; version=0.0.4; charset=utf-8");
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
  self->guard_ = guard;
  self->thread_ = std::thread([s = self->server_.get(), stopped = self->stopped_] {
    s->listen_after_bind();
    stopped->Notify();
  });
  // stop() only stops a server that is running: wait for that, so the destructor never waits for
  // a listener that started after it.
  for (int i = 0; i < 5000 && !self->server_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  PW_LOG(Info) << "dashboard and metrics at http://" << options.ip << ":" << port << "/";
  return self;
}

StatusHttpServer::StatusHttpServer(std::unique_ptr<httplib::Server> server, int port)
    : server_(std::move(server)), port_(port), stopped_(std::make_shared<absl::Notification>()) {}

StatusHttpServer::~StatusHttpServer() {
  guard_->Close();  // no request reads the controller from now on
  server_->stop();
  // Stopping joins the threads serving connections, and a client trickling a byte per timeout
  // keeps its thread: the controller's shutdown does not wait for it. The server is then left to
  // its threads (answering 503) until the process ends.
  if (stopped_->WaitForNotificationWithTimeout(absl::Seconds(5))) {
    thread_.join();
    return;
  }
  PW_LOG(Warning) << "HTTP server on port " << port_ << " still serves a slow client; left behind";
  thread_.detach();
  (void)server_.release();
}

}  // namespace pathways
