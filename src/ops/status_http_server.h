// The controller's HTTP face for operators: a live dashboard (static assets compiled into the
// binary from src/ops/assets/), the cluster's state as JSON at /api/status (and the devices'
// recent work at /api/timeline), and Prometheus
// metrics at /metrics. Built on cpp-httplib (Debian's libcpp-httplib-dev).
//
// With a token set, every request must carry it, as `Authorization: Bearer TOKEN` or as a
// `token` query parameter (what a browser opening the page can send); the page passes the one
// it was opened with on to its own requests. Nothing but the fixed routes is served: the assets
// are not files looked up at run time; only GETs without a body are. Connections are bounded in
// number, each request head in time and bytes, each answer in time (gated_http_server.h: slow
// and silent clients wait on one polling thread; no thread that answers waits for a client), so
// a malformed or slow client fails alone.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "proto/pathways.pb.h"
#include "transport/tenant_tokens.h"

namespace httplib {
class Server;
}

namespace pathways {

struct StatusHttpOptions {
  std::string ip = "127.0.0.1";
  int port = 0;  // 0: pick a free one
  TenantTokens token;  // any tenant's token (or the shared one) is admitted; open: none asked for
  int threads = 4;            // answering requests (a connection waiting for one holds none)
  int max_connections = 256;  // open at once; beyond it the longest waiting make room
  int timeout_seconds = 3;    // for a whole request head, a whole answer, an idle kept connection
};

class StatusHttpServer {
 public:
  using StatusFn = std::function<rpc::ClusterStatus()>;
  using TimelineFn = std::function<rpc::ClusterTimeline()>;
  // Listening once it returns. `status` is called for every page and metrics request, on the
  // server's threads; `timeline`, when given, for every /api/timeline request (the devices' last
  // seconds of work, which the dashboard draws).
  static absl::StatusOr<std::unique_ptr<StatusHttpServer>> Start(StatusHttpOptions options, StatusFn status,
                                                                 TimelineFn timeline = nullptr);
  ~StatusHttpServer();  // stops listening and joins the threads
  StatusHttpServer(const StatusHttpServer&) = delete;
  StatusHttpServer& operator=(const StatusHttpServer&) = delete;

  int port() const { return port_; }

 private:
  StatusHttpServer(std::unique_ptr<httplib::Server> server, int port);
  std::unique_ptr<httplib::Server> server_;
  int port_;
  std::thread thread_;
};

// The cluster's state as the dashboard and `pathways status --json` read it.
std::string StatusJson(const rpc::ClusterStatus& status);

}  // namespace pathways
