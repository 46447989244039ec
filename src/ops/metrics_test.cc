#include "ops/metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "testing/prometheus_text.h"

namespace pathways {
namespace {

rpc::ClusterStatus TwoHostStatus() {
  rpc::ClusterStatus status;
  for (int h = 0; h < 2; ++h) {
    rpc::HostStatus* host = status.add_hosts();
    host->set_host_id(h);
    host->set_island(h);
    host->set_address("127.0.0.1:" + std::to_string(4000 + h));
    host->set_alive(h == 0);
    host->set_millis_since_heartbeat(h == 0 ? 120 : 9000);
    rpc::DeviceInfo* d = host->add_devices();
    d->set_device_id(h);
    d->set_kind("cpu");
    d->set_memory_capacity(int64_t{3} << 30);  // 3 GiB: more digits than %g keeps
    d->set_memory_used(123456789);
    d->set_memory_peak(223456789);
    d->set_busy_micros(1500000);
    d->set_executed(42);
    rpc::ClientTime* t = d->add_client_time();
    t->set_client_id("ab\"c\\d\ne");  // every character the format escapes
    t->set_busy_micros(250000);
    if (h == 0) {
      rpc::HostCounters* c = host->mutable_counters();
      c->set_blocks_sent(3);
      c->set_block_bytes_sent(int64_t{5} << 30);
      c->set_dataflow_bytes_received(777);
      c->set_collectives(6);
      c->set_collectives_failed(1);
      for (double b : {100.0, 1000.0}) c->add_latency_bounds_us(b);
      for (int64_t n : {2, 3, 1}) c->add_latency_buckets(n);
      c->set_latency_sum_us(9000);
      c->set_runs_in_flight(5);
      c->set_collectives_in_progress(3);
      c->set_compiled_functions(4);
      c->set_compiled_bytes(1 << 20);
      rpc::ClientCount* failed = c->add_failed_shards();
      failed->set_client_id("0123abcd");
      failed->set_count(4);
    }
  }
  rpc::SchedulerStatus* s = status.add_schedulers();
  s->set_island(0);
  s->set_policy("proportional-share");
  s->set_rounds(7);
  s->set_released_runs(10);
  s->set_release_wait_us_sum(2500);
  for (double b : {100.0, 1000.0}) s->add_release_wait_bounds_us(b);
  for (int64_t n : {7, 3, 0}) s->add_release_wait_buckets(n);
  s->set_runs_in_flight(5);
  rpc::SchedulerClientStatus* c = s->add_clients();
  c->set_client_id("0123abcd");
  c->set_weight(2.5);
  c->set_queued_runs(3);
  c->set_released_runs(10);
  rpc::SliceStatus* slice = status.add_slices();
  slice->set_slice_id(1);
  slice->add_device_ids(0);
  slice->add_device_ids(1);
  status.set_live_clients(1);
  return status;
}

TEST(MetricsTest, TheExpositionParsesAndCarriesEveryFigure) {
  const PrometheusSamples p = ParsePrometheusText(PrometheusText(TwoHostStatus()));
  EXPECT_TRUE(p.errors.empty()) << p.errors.front();
  EXPECT_EQ(p.types.at("pathways_device_busy_seconds_total"), "counter");
  EXPECT_EQ(p.types.at("pathways_scheduler_release_wait_seconds"), "histogram");
  const std::string dev0 = R"({host="127.0.0.1:4000",island="0",device="0",kind="cpu"})";
  EXPECT_EQ(p.samples.at("pathways_device_memory_limit_bytes" + dev0), 3221225472.0);
  EXPECT_EQ(p.samples.at("pathways_device_memory_used_bytes" + dev0), 123456789.0);
  EXPECT_EQ(p.samples.at("pathways_device_busy_seconds_total" + dev0), 1.5);
  EXPECT_EQ(p.samples.at("pathways_device_computations_total" + dev0), 42.0);
  EXPECT_EQ(p.samples.at(R"(pathways_host_up{host="127.0.0.1:4001",island="1"})"), 0.0);
  EXPECT_EQ(p.samples.at(R"(pathways_device_client_busy_seconds_total{host="127.0.0.1:4000",island="0",device="0",kind="cpu",client="ab\"c\\d\ne"})"),
            0.25);
  const std::string island = R"({island="0",policy="proportional-share"})";
  EXPECT_EQ(p.samples.at("pathways_scheduler_release_wait_seconds_sum" + island), 0.0025);
  EXPECT_EQ(p.samples.at("pathways_scheduler_release_wait_seconds_count" + island), 10.0);
  const std::string wait = R"(pathways_scheduler_release_wait_seconds_bucket{island="0",policy="proportional-share",le=")";
  EXPECT_EQ(p.samples.at(wait + R"(0.0001"})"), 7.0);
  EXPECT_EQ(p.samples.at(wait + R"(0.001"})"), 10.0);
  EXPECT_EQ(p.samples.at(wait + R"(+Inf"})"), 10.0);
  EXPECT_EQ(p.samples.at("pathways_scheduler_queued_runs" + island), 3.0);
  EXPECT_EQ(p.samples.at("pathways_scheduler_runs_in_flight" + island), 5.0);
  EXPECT_EQ(p.samples.at(R"(pathways_host_runs_in_flight{host="127.0.0.1:4000",island="0"})"), 5.0);
  EXPECT_EQ(p.samples.at(R"(pathways_host_collectives_in_progress{host="127.0.0.1:4000",island="0"})"), 3.0);
  EXPECT_EQ(p.samples.at(R"(pathways_host_compiled_functions{host="127.0.0.1:4000",island="0"})"), 4.0);
  EXPECT_EQ(p.samples.at(R"(pathways_host_compiled_bytes{host="127.0.0.1:4000",island="0"})"), 1048576.0);
  EXPECT_EQ(p.samples.at(R"(pathways_client_weight{island="0",client="0123abcd"})"), 2.5);
  EXPECT_EQ(p.samples.at("pathways_live_clients"), 1.0);
  EXPECT_EQ(p.samples.at("pathways_slices"), 1.0);
  EXPECT_EQ(p.samples.at("pathways_slice_devices"), 2.0);
}

TEST(MetricsTest, HostCountersAndTheCollectiveLatencyHistogram) {
  const PrometheusSamples p = ParsePrometheusText(PrometheusText(TwoHostStatus()));
  EXPECT_TRUE(p.errors.empty()) << p.errors.front();
  const std::string host0 = R"({host="127.0.0.1:4000",island="0"})";
  EXPECT_EQ(p.samples.at("pathways_host_blocks_sent_total" + host0), 3.0);
  EXPECT_EQ(p.samples.at("pathways_host_block_sent_bytes_total" + host0), 5368709120.0);
  EXPECT_EQ(p.samples.at("pathways_host_dataflow_received_bytes_total" + host0), 777.0);
  EXPECT_EQ(p.samples.at("pathways_host_collectives_total" + host0), 6.0);
  EXPECT_EQ(p.samples.at("pathways_host_collective_failures_total" + host0), 1.0);
  EXPECT_EQ(p.types.at("pathways_host_collective_latency_seconds"), "histogram");
  // Cumulative buckets, in seconds, ending at +Inf with the count.
  const std::string bucket = R"(pathways_host_collective_latency_seconds_bucket{host="127.0.0.1:4000",island="0",le=")";
  EXPECT_EQ(p.samples.at(bucket + R"(0.0001"})"), 2.0);
  EXPECT_EQ(p.samples.at(bucket + R"(0.001"})"), 5.0);
  EXPECT_EQ(p.samples.at(bucket + R"(+Inf"})"), 6.0);
  EXPECT_EQ(p.samples.at("pathways_host_collective_latency_seconds_count" + host0), 6.0);
  EXPECT_EQ(p.samples.at("pathways_host_collective_latency_seconds_sum" + host0), 0.009);
  EXPECT_EQ(p.samples.at(R"(pathways_client_failed_shards_total{host="127.0.0.1:4000",island="0",client="0123abcd"})"),
            4.0);
  // A host whose heartbeat carried no histogram has none, but still its counters.
  const std::string host1 = R"({host="127.0.0.1:4001",island="1"})";
  EXPECT_FALSE(p.samples.contains("pathways_host_collective_latency_seconds_count" + host1));
  EXPECT_EQ(p.samples.at("pathways_host_collectives_total" + host1), 0.0);
}

// Each client's share of its island's device time over the status's timeline, as the dashboard
// measures it; none without a timeline, and none for a client without recent work.
TEST(MetricsTest, ClientSharesComeFromTheRecentWorkOfTheirIsland) {
  rpc::ClusterStatus status = TwoHostStatus();
  rpc::SchedulerClientStatus* idle = status.mutable_schedulers(0)->add_clients();
  idle->set_client_id("idle0000");
  EXPECT_FALSE(ParsePrometheusText(PrometheusText(status)).samples.contains(
      R"(pathways_client_device_share{island="0",client="0123abcd"})"));
  auto work = [&](const std::string& host, std::vector<std::pair<std::string, int64_t>> busy) {
    rpc::DeviceTimeline* d = status.mutable_timeline()->add_devices();
    d->set_host(host);
    rpc::WorkBucket* b = d->add_buckets();
    b->set_start_us(0);
    b->set_end_us(100000);
    for (const auto& [client, micros] : busy) {
      rpc::ClientTime* t = b->add_busy();
      t->set_client_id(client);
      t->set_busy_micros(micros);
    }
  };
  work("127.0.0.1:4000", {{"0123abcd", 30000}, {"other000", 10000}});
  work("127.0.0.1:4000", {{"0123abcd", 50000}, {"other000", 10000}});
  work("127.0.0.1:4001", {{"0123abcd", 90000}});  // island 1: not in island 0's share
  work("10.0.0.1:1", {{"0123abcd", 90000}});      // a host the status does not know
  const PrometheusSamples p = ParsePrometheusText(PrometheusText(status));
  EXPECT_TRUE(p.errors.empty()) << p.errors.front();
  EXPECT_EQ(p.types.at("pathways_client_device_share"), "gauge");
  EXPECT_DOUBLE_EQ(p.samples.at(R"(pathways_client_device_share{island="0",client="0123abcd"})"), 0.8);
  EXPECT_FALSE(p.samples.contains(R"(pathways_client_device_share{island="0",client="idle0000"})"));
}

TEST(MetricsTest, AnEmptyClusterStillDeclaresItsFamilies) {
  const PrometheusSamples p = ParsePrometheusText(PrometheusText(rpc::ClusterStatus()));
  EXPECT_TRUE(p.errors.empty()) << p.errors.front();
  EXPECT_TRUE(p.types.contains("pathways_host_up"));
  EXPECT_EQ(p.samples.at("pathways_live_clients"), 0.0);
}

TEST(MetricsTest, LabelValuesAreEscaped) {
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
}

}  // namespace
}  // namespace pathways
