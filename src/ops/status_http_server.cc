#include "ops/status_http_server.h"

#include <arpa/inet.h>
#include <google/protobuf/util/json_util.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cctype>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "ops/assets.h"
#include "ops/gated_http_server.h"
#include "ops/metrics.h"
#include "transport/auth.h"

namespace pathways {

namespace {

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
  if (options.threads < 1 || options.max_connections < 1 || options.timeout_seconds < 1) {
    return absl::InvalidArgumentError("the HTTP server needs at least one thread, one connection and a timeout");
  }
  HttpGateOptions gate;
  gate.threads = options.threads;
  gate.max_connections = options.max_connections;
  auto server = std::make_unique<GatedHttpServer>(gate);
  server->set_socket_options(ExclusiveSocketOptions);
  server->set_read_timeout(options.timeout_seconds, 0);  // for a whole request head
  server->set_write_timeout(options.timeout_seconds, 0);  // for a whole answer
  server->set_keep_alive_timeout(options.timeout_seconds);
  // A kept connection waits on the gate's polling thread, not on a thread of its own: a dashboard
  // polling every second keeps one open.
  server->set_keep_alive_max_count(100);
  server->set_payload_max_length(64 << 10);

  const TenantTokens token = options.token;
  // A server on loopback is what a page rebinding its name reaches through the operator's browser;
  // one on another address is reached by name legitimately (a Kubernetes Service, Prometheus).
  in_addr v4;
  const bool on_loopback = options.ip == "::1" || options.ip == "[::1]" || options.ip == "localhost" ||
                           (inet_pton(AF_INET, options.ip.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127);
  const bool by_address_only = token.open() && on_loopback;
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
  // The destructor joins every thread that runs these, so `status` and `timeline` are only called
  // while the server exists.
  server->Get(ExactRoute("/api/status"), [status](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(StatusJson(status()), "application/json");
  });
  if (timeline) {
    server->Get(ExactRoute("/api/timeline"), [timeline](const httplib::Request&, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_content(Json(timeline()), "application/json");
    });
  }
  server->Get(ExactRoute("/metrics"), [status, timeline](const httplib::Request&, httplib::Response& res) {
    rpc::ClusterStatus s = status();
    if (timeline) *s.mutable_timeline() = timeline();  // for the clients' recent shares
    res.set_content(PrometheusText(s), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) res.set_content(absl::StrCat("HTTP ", res.status, "\n"), "text/plain");
  });
  server->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
    res.status = 500;
    res.set_content("internal error\n", "text/plain");
  });

  const int port = server->Bind(options.ip, options.port);
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("HTTP server: cannot listen on ", options.ip, ":", options.port,
                                               " (in use, or not an address of this machine)"));
  }
  std::unique_ptr<StatusHttpServer> self(new StatusHttpServer(std::move(server), port));
  self->thread_ = std::thread([s = self->server_.get()] {
    NameThisThread("http-listen");
    s->listen_after_bind();
  });
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
  thread_.join();  // accepting never blocks: the gate takes connections as they come
  server_.reset();  // joins the threads answering requests, each within its write timeout
}

}  // namespace pathways
