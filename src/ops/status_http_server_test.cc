#include "ops/status_http_server.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"

namespace pathways {
namespace {

rpc::ClusterStatus OneHost() {
  rpc::ClusterStatus status;
  rpc::HostStatus* h = status.add_hosts();
  h->set_address("127.0.0.1:4000");
  h->set_alive(true);
  rpc::DeviceInfo* d = h->add_devices();
  d->set_device_id(3);
  d->set_kind("cpu");
  d->set_memory_capacity(1 << 20);
  status.set_live_clients(2);
  return status;
}

std::unique_ptr<StatusHttpServer> Serve(StatusHttpOptions options = {}) {
  auto server = StatusHttpServer::Start(std::move(options), [] { return OneHost(); });
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

httplib::Client ClientOf(const StatusHttpServer& server) {
  httplib::Client client("127.0.0.1", server.port());
  client.set_connection_timeout(10);
  client.set_read_timeout(30);
  return client;
}

TEST(StatusHttpServerTest, ServesTheDashboardStatusAndMetrics) {
  auto server = Serve();
  ASSERT_NE(server, nullptr);
  httplib::Client client = ClientOf(*server);
  auto page = client.Get("/");
  ASSERT_TRUE(page) << httplib::to_string(page.error());
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->body.find("dashboard.js"), std::string::npos);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  auto script = client.Get("/dashboard.js");
  ASSERT_TRUE(script);
  EXPECT_EQ(script->status, 200);
  EXPECT_NE(script->body.find("api/status"), std::string::npos);

  auto json = client.Get("/api/status");
  ASSERT_TRUE(json);
  EXPECT_EQ(json->status, 200);
  rpc::ClusterStatus parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json->body, &parsed).ok()) << json->body;
  ASSERT_EQ(parsed.hosts_size(), 1);
  EXPECT_EQ(parsed.hosts(0).devices(0).device_id(), 3);
  EXPECT_EQ(parsed.live_clients(), 2);
  EXPECT_EQ(StatusJson(OneHost()), json->body);  // `pathways status --json` prints the same

  auto metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  EXPECT_NE(metrics->body.find("pathways_live_clients 2\n"), std::string::npos);
}

TEST(StatusHttpServerTest, TheTimelineIsServedWhenThereIsOne) {
  auto with = StatusHttpServer::Start({}, [] { return OneHost(); }, [] {
    rpc::ClusterTimeline t;
    t.set_now_us(5000);
    rpc::DeviceTimeline* d = t.add_devices();
    d->set_device_id(3);
    rpc::WorkBucket* b = d->add_buckets();
    b->set_start_us(4000);
    b->set_end_us(4500);
    rpc::ClientTime* busy = b->add_busy();
    busy->set_client_id("abcd1234");
    busy->set_busy_micros(300);
    return t;
  });
  ASSERT_TRUE(with.ok()) << with.status();
  httplib::Client client = ClientOf(**with);
  auto json = client.Get("/api/timeline");
  ASSERT_TRUE(json) << httplib::to_string(json.error());
  EXPECT_EQ(json->status, 200);
  rpc::ClusterTimeline parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json->body, &parsed).ok()) << json->body;
  ASSERT_EQ(parsed.devices_size(), 1);
  EXPECT_EQ(parsed.devices(0).buckets(0).busy(0).client_id(), "abcd1234");
  EXPECT_EQ(parsed.now_us(), 5000);

  auto without = Serve();
  ASSERT_NE(without, nullptr);
  httplib::Client other = ClientOf(*without);
  auto missing = other.Get("/api/timeline");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
}

TEST(StatusHttpServerTest, NothingButItsRoutesIsServed) {
  auto server = Serve();
  ASSERT_NE(server, nullptr);
  httplib::Client client = ClientOf(*server);
  for (const char* path : {"/../../etc/passwd", "/assets/index.html", "/index.html/..", "/metricsx", "/api",
                           "/%2e%2e/%2e%2e/etc/passwd", "/CMakeLists.txt"}) {
    auto r = client.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path;
  }
  auto post = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  for (const char* path : {"/dashboardXjs", "/api/statusX", "/metrics/"}) {  // routes match exactly
    auto r = client.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path;
  }
}

TEST(StatusHttpServerTest, WithATokenEveryRequestMustCarryIt) {
  StatusHttpOptions options;
  options.token = "s3cret";
  auto server = Serve(options);
  ASSERT_NE(server, nullptr);
  httplib::Client client = ClientOf(*server);
  for (const char* path : {"/", "/api/status", "/metrics", "/nothing"}) {
    auto r = client.Get(path);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401) << path;
    EXPECT_EQ(r->body.find("s3cret"), std::string::npos);  // never says what it should be
  }
  auto wrong = client.Get("/metrics", {{"Authorization", "Bearer s3cres"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto bearer = client.Get("/metrics", {{"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(bearer);
  EXPECT_EQ(bearer->status, 200);
  auto query = client.Get("/?token=s3cret");  // how a browser opens the page
  ASSERT_TRUE(query);
  EXPECT_EQ(query->status, 200);
}

// Garbage, requests cut short and clients that send nothing: each connection fails on its own
// (or times out), and the server answers the next well-formed request.
TEST(StatusHttpServerTest, SurvivesGarbageAndSlowClients) {
  StatusHttpOptions options;
  options.threads = 1;
  options.max_connections = 16;
  options.timeout_seconds = 60;  // none of these is let go by a timeout
  auto server = Serve(options);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> garbage = {
      std::string("\x00\x01\x02\xff garbage\r\n\r\n", 16), "GET\r\n\r\n", "GET / HTTP/9.9\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
      "GET /" + std::string(100000, 'a') + " HTTP/1.1\r\n\r\n",
      "GET /metrics HTTP/1.1\r\n" + std::string(20000, 'h') + ": v\r\n\r\n", "GET /metrics HTTP/1.1\r\nHost",
      // A body is refused before it is read: cpp-httplib would read a chunked one whole.
      "POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nfffffff\r\n" + std::string(65536, 'b')};
  for (const std::string& g : garbage) {
    const int fd = testing::DialLoopback(server->port());
    ASSERT_GE(fd, 0);
    timeval bound{60, 0};  // a regression fails here instead of hanging
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
    (void)send(fd, g.data(), g.size(), MSG_NOSIGNAL);
    shutdown(fd, SHUT_WR);
    char buffer[256];
    while (read(fd, buffer, sizeof(buffer)) > 0) {
    }
    close(fd);
  }
  // More silent connections than threads: they hold none (gated_http_server.h), and the request
  // behind them is served at once, long before their timeout.
  std::vector<int> silent;
  for (int i = 0; i < 6; ++i) {
    const int fd = testing::DialLoopback(server->port());
    ASSERT_GE(fd, 0);
    silent.push_back(fd);
  }
  httplib::Client client = ClientOf(*server);
  auto r = client.Get("/metrics");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  for (int fd : silent) close(fd);
}

// Without a token, a request that names the server by a host name (a page whose name was rebound
// to 127.0.0.1) is refused; by address or as localhost it is served; with a token, a host name
// may be used (the token is what keeps other pages out).
TEST(StatusHttpServerTest, WithoutATokenOnlyRequestsToItsAddressAreServed) {
  auto open = Serve();
  ASSERT_NE(open, nullptr);
  httplib::Client client = ClientOf(*open);
  for (const char* host : {"attacker.example", "attacker.example:80", "localhost.attacker.example"}) {
    auto r = client.Get("/api/status", {{"Host", host}});
    ASSERT_TRUE(r) << host;
    EXPECT_EQ(r->status, 403) << host;
  }
  for (const std::string host : {std::string("localhost"), absl::StrCat("127.0.0.1:", open->port()),
                                 absl::StrCat("LOCALHOST:", open->port()), std::string("[::1]:80")}) {
    auto r = client.Get("/api/status", {{"Host", host}});
    ASSERT_TRUE(r) << host;
    EXPECT_EQ(r->status, 200) << host;
  }

  StatusHttpOptions options;
  options.token = "s3cret";
  auto guarded = Serve(options);
  ASSERT_NE(guarded, nullptr);
  httplib::Client with_token = ClientOf(*guarded);
  auto r = with_token.Get("/api/status", {{"Host", "dashboard.example"}, {"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST(StatusHttpServerTest, APortInUseIsRefused) {
  auto first = Serve();
  ASSERT_NE(first, nullptr);
  StatusHttpOptions options;
  options.port = first->port();
  auto second = StatusHttpServer::Start(options, [] { return OneHost(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(std::to_string(first->port())), std::string::npos);
  options.port = 70000;
  EXPECT_EQ(StatusHttpServer::Start(options, [] { return OneHost(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pathways
