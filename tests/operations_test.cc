// The controller's HTTP face on a real cluster: a controller (with --http-port and a token) and a
// worker started from the `pathways` binary, a tenant in this process, and what /metrics,
// /api/status and `pathways status --json` say about them.
#include <signal.h>

#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include "client/client.h"
#include "gtest/gtest.h"
#include "proto/pathways.pb.h"
#include "testing/prometheus_text.h"
#include "testing/subprocess.h"
#include "transport/auth.h"

namespace pathways {
namespace {

constexpr absl::Duration kStartTimeout = absl::Seconds(60);
constexpr char kToken[] = "operations-test-token";

// The value of the first sample in `text` whose line starts with `prefix` and whose labels end
// with `labels_end`; -1 when there is none.
double FirstSample(const std::string& text, const std::string& prefix, const std::string& labels_end = "}") {
  for (size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1)) {
    if (at > 0 && text[at - 1] != '\n') continue;
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    const size_t close = line.rfind("} ");
    if (close == std::string::npos || !line.substr(0, close + 1).ends_with(labels_end)) continue;
    return std::stod(line.substr(close + 2));
  }
  return -1;
}

class OperationsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(controller_.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0", "--http-port", "0",
                                   "--token", kToken, "--cluster-token", "operations-test-cluster",
                                   "--heartbeat-timeout-ms", "1000", "--scheduler", "share"})
                    .ok());
    auto line = controller_.WaitForLine("listening on", kStartTimeout);
    ASSERT_TRUE(line.ok()) << line.status();
    address_ = line->substr(line->rfind(' ') + 1);
    auto dashboard = controller_.WaitForLine("dashboard at", kStartTimeout);
    ASSERT_TRUE(dashboard.ok()) << dashboard.status();
    // "dashboard at http://127.0.0.1:PORT/"
    http_port_ = std::stoi(dashboard->substr(dashboard->rfind(':') + 1));
    ASSERT_TRUE(worker_.Start({PATHWAYS_BINARY, "worker", "--controller", address_, "--devices", "2",
                               "--device-memory", "64MiB", "--token", kToken, "--cluster-token",
                               "operations-test-cluster"})
                    .ok());
    ASSERT_TRUE(worker_.WaitForLine("serving", kStartTimeout).ok());
    SetCallToken(kToken);
  }
  void TearDown() override {
    for (auto* p : {&worker_, &controller_}) {
      if (p->pid() > 0) p->Stop(SIGTERM);
    }
    SetCallToken("");
  }

  httplib::Result Get(const std::string& path, bool with_token = true) {
    httplib::Client http("127.0.0.1", http_port_);
    http.set_read_timeout(30);
    httplib::Headers headers;
    if (with_token) headers.emplace("Authorization", std::string("Bearer ") + kToken);
    return http.Get(path, headers);
  }

  Subprocess controller_, worker_;
  std::string address_;
  int http_port_ = 0;
};

TEST_F(OperationsTest, MetricsAndStatusShowTheHostsATenantsSliceAndItsRuns) {
  auto connected = Client::Connect(address_, {.weight = 3});
  ASSERT_TRUE(connected.ok()) << connected.status();
  auto client = *std::move(connected);
  VirtualSlice slice = *client->CreateSlice({.mesh_shape = {2}});
  CompiledFunction inc = *client->Compile(
      FunctionSpec::Builtin("add_one", {{DType::kF32, {2}}}, {{DType::kF32, {2}}}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client->Put(*HostArray::Create(DType::kF32, {2}), slice, {"x"});
  for (int i = 0; i < 20; ++i) x = (*client->Call(inc, slice, {x}))[0];
  ASSERT_EQ((*client->Fetch(x).Await()).data<float>()[0], 20.0f);
  // Three all_reduces over both devices: six member calls in the host's collective counters.
  CompiledFunction sum = *client->Compile(
      FunctionSpec::Builtin("all_reduce_sum", {{DType::kF32, {2}}}, {{DType::kF32, {2}}}, {{"x"}}, {{"x"}}));
  for (int i = 0; i < 3; ++i) x = (*client->Call(sum, slice, {x}))[0];
  ASSERT_EQ((*client->Fetch(x).Await()).data<float>()[0], 20.0f * 8);
  // A run that fails on both devices: two failed shards of this client in the host's counters.
  CompiledFunction boom = *client->Compile(FunctionSpec::Script(
      "boom", "def boom(x):\n    assert bool(x.sum() < -1000.0), 'kaboom'\n    return x\n", {{DType::kF32, {2}}},
      {{DType::kF32, {2}}}, {{"x"}}, {{"x"}}));
  ShardedArray failed = (*client->Call(boom, slice, {x}))[0];
  ASSERT_FALSE(client->Fetch(failed).Await().ok());
  const std::string label = client->id().substr(0, 8);

  auto refused = Get("/metrics", /*with_token=*/false);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);

  // Device counters come with the worker's heartbeats: wait (bounded) for the one after the runs.
  std::string metrics;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto r = Get("/metrics");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    ASSERT_EQ(r->status, 200);
    metrics = r->body;
    if (metrics.find("pathways_device_client_busy_seconds_total{") != std::string::npos &&
        metrics.find("client=\"" + label + "\"} ") != std::string::npos &&
        FirstSample(metrics, "pathways_host_collectives_total{") == 6 &&
        FirstSample(metrics, "pathways_client_failed_shards_total{") == 2) {
      break;  // a device has reported time spent for this client, and the host its collectives
    }
    absl::SleepFor(absl::Milliseconds(100));  // the next heartbeat, not a result, is awaited
  }
  // Every line as a scraper reads it.
  const PrometheusSamples parsed_metrics = ParsePrometheusText(metrics);
  EXPECT_TRUE(parsed_metrics.errors.empty()) << parsed_metrics.errors.front() << "\n" << metrics;
  EXPECT_EQ(parsed_metrics.types.at("pathways_scheduler_release_wait_seconds"), "histogram");
  auto sample = [&](const std::string& key) {
    auto it = parsed_metrics.samples.find(key);
    EXPECT_NE(it, parsed_metrics.samples.end()) << key << " is not in:\n" << metrics;
    return it == parsed_metrics.samples.end() ? -1.0 : it->second;
  };
  EXPECT_EQ(sample(R"(pathways_scheduler_release_wait_seconds_count{island="0",policy="proportional-share"})"), 24);
  // The only client: all of the island's recent device time is its.
  EXPECT_EQ(sample("pathways_client_device_share{island=\"0\",client=\"" + label + "\"}"), 1);
  EXPECT_NE(metrics.find("pathways_host_up{host=\"127.0.0.1:"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\",island=\"0\"} 1\n"), std::string::npos) << metrics;  // up
  EXPECT_NE(metrics.find("pathways_client_weight{island=\"0\",client=\"" + label + "\"} 3\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("pathways_client_released_runs_total{island=\"0\",client=\"" + label + "\"} 24\n"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("pathways_live_clients 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("pathways_slice_devices 2\n"), std::string::npos) << metrics;
  // The host's own counters: its collectives and their latency histogram.
  EXPECT_EQ(FirstSample(metrics, "pathways_host_collectives_total{host=\"127.0.0.1:"), 6) << metrics;
  EXPECT_EQ(FirstSample(metrics, "pathways_host_collective_failures_total{host=\"127.0.0.1:"), 0) << metrics;
  EXPECT_EQ(FirstSample(metrics, "pathways_host_collective_latency_seconds_count{host=\"127.0.0.1:"), 6) << metrics;
  EXPECT_EQ(FirstSample(metrics, "pathways_host_collective_latency_seconds_bucket{host=\"127.0.0.1:", "le=\"+Inf\"}"), 6)
      << metrics;
  EXPECT_EQ(FirstSample(metrics, "pathways_client_failed_shards_total{host=\"127.0.0.1:", "client=\"" + label + "\"}"), 2)
      << metrics;
  // The runs' control messages came to the worker over the dataflow engine.
  EXPECT_GT(FirstSample(metrics, "pathways_host_dataflow_received_bytes_total{host=\"127.0.0.1:"), 0) << metrics;

  // The devices' recent work, from their trace rings through the heartbeats, labelled by client.
  auto timeline_json = Get("/api/timeline");
  ASSERT_TRUE(timeline_json);
  ASSERT_EQ(timeline_json->status, 200);
  rpc::ClusterTimeline timeline;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(timeline_json->body, &timeline).ok()) << timeline_json->body;
  ASSERT_EQ(timeline.devices_size(), 2);
  int64_t busy = 0;
  for (const rpc::DeviceTimeline& d : timeline.devices()) {
    EXPECT_GT(d.buckets_size(), 0) << timeline_json->body;
    for (const rpc::WorkBucket& b : d.buckets()) {
      EXPECT_LT(b.start_us(), b.end_us());
      for (const rpc::ClientTime& t : b.busy()) {
        EXPECT_EQ(t.client_id(), label);
        busy += t.busy_micros();
      }
    }
  }
  EXPECT_GT(busy, 0) << timeline_json->body;

  auto page = Get("/?token=" + std::string(kToken), /*with_token=*/false);
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);

  Subprocess status;
  ASSERT_TRUE(status.Start({PATHWAYS_BINARY, "status", "--controller", address_, "--token", kToken, "--json"}).ok());
  auto json = status.WaitForLine("{", absl::Seconds(60));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(status.Wait(), 0);
  rpc::ClusterStatus parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(*json, &parsed).ok()) << *json;
  ASSERT_EQ(parsed.hosts_size(), 1);
  EXPECT_EQ(parsed.hosts(0).devices_size(), 2);
  ASSERT_EQ(parsed.slices_size(), 1);
  EXPECT_EQ(parsed.slices(0).client_id(), label);
  EXPECT_EQ(parsed.slices(0).device_ids_size(), 2);
  ASSERT_EQ(parsed.schedulers_size(), 1);
  EXPECT_EQ(parsed.schedulers(0).policy(), "proportional-share");
  EXPECT_EQ(parsed.schedulers(0).released_runs(), 24);
  // And the devices' recent work, as the dashboard draws it.
  EXPECT_EQ(parsed.timeline().devices_size(), 2) << *json;
  EXPECT_EQ(parsed.timeline().window_us(), 10'000'000);
}

}  // namespace
}  // namespace pathways
