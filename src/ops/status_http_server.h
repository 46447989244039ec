// The controller's HTTP face for operators: a live dashboard (static assets compiled into the
// binary from src/ops/assets/), the cluster's state as JSON at /api/status (and the devices'
// recent work at /api/timeline), and Prometheus
// metrics at /metrics. Built on cpp-httplib (Debian's libcpp-httplib-dev).
//
// With a token set, every request must carry it, as `Authorization: Bearer TOKEN` or as a
// `token` query parameter (what a browser opening the page can send); the page passes the one
// it was opened with on to its own requests. Nothing but the fixed routes is served: the assets
// are not files looked up at run time; only GETs without a body are. Connections are bounded (a
// few threads, a bounded queue behind them, then the kernel's backlog) and so is each read and
// write (timeouts), so a malformed client fails alone. Limits of cpp-httplib 0.11 that remain: a
// client that trickles a byte per timeout holds its thread, and the number of a request's
// headers is not bounded; keep the port on loopback or behind a firewall (docs/reliability.md).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "proto/pathways.pb.h"

namespace httplib {
class Server;
}

namespace pathways {

class StatusGuard;

struct StatusHttpOptions {
  std::string ip = "127.0.0.1";
  int port = 0;  // 0: pick a free one
  std::string token;  // empty: none asked for
  int threads = 8;
  int max_queued_connections = 64;
  int timeout_seconds = 3;  // per read and per write, and for an idle keep-alive connection
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
  std::shared_ptr<absl::Notification> stopped_;  // the listening thread returned
  std::shared_ptr<StatusGuard> guard_;
  std::thread thread_;
};

// The cluster's state as the dashboard and `pathways status --json` read it.
std::string StatusJson(const rpc::ClusterStatus& status);

}  // namespace pathways
