#include "ops/metrics.h"

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// A reader of Prometheus' text format strict enough to catch what a scraper refuses: every
// sample belongs to a family declared before it (HELP and TYPE), names and labels are well
// formed, label values are escaped and values parse.
struct Parsed {
  std::map<std::string, std::string> types;           // family -> type
  std::map<std::string, double> samples;              // "name{labels}" -> value
  std::vector<std::string> errors;
};

Parsed Parse(const std::string& text) {
  Parsed p;
  static const std::regex kHelp(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+)");
  static const std::regex kType(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|summary|histogram|untyped))");
  static const std::regex kSample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")*\})? (\S+))");
  std::istringstream in(text);
  std::string line;
  std::set<std::string> helped;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, kHelp)) {
      helped.insert(m[1]);
    } else if (std::regex_match(line, m, kType)) {
      if (!helped.contains(m[1])) p.errors.push_back("TYPE before HELP: " + line);
      p.types[m[1]] = m[2];
    } else if (std::regex_match(line, m, kSample)) {
      std::string family = m[1];
      for (const char* suffix : {"_sum", "_count", "_bucket"}) {
        const std::string s = suffix;
        if (!p.types.contains(family) && family.size() > s.size() && family.ends_with(s)) {
          family = family.substr(0, family.size() - s.size());
        }
      }
      if (!p.types.contains(family)) p.errors.push_back("sample of an undeclared family: " + line);
      char* end = nullptr;
      const std::string value = m[7];
      const double v = std::strtod(value.c_str(), &end);
      if (end == nullptr || *end != '\0') p.errors.push_back("value does not parse: " + line);
      const std::string key = std::string(m[1]) + std::string(m[2]);
      if (p.samples.contains(key)) p.errors.push_back("sample twice: " + line);
      p.samples[key] = v;
    } else {
      p.errors.push_back("not a line of the format: " + line);
    }
  }
  return p;
}

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
  const Parsed p = Parse(PrometheusText(TwoHostStatus()));
  EXPECT_TRUE(p.errors.empty()) << p.errors.front();
  EXPECT_EQ(p.types.at("pathways_device_busy_seconds_total"), "counter");
  EXPECT_EQ(p.types.at("pathways_scheduler_release_wait_seconds"), "summary");
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
  EXPECT_EQ(p.samples.at("pathways_scheduler_queued_runs" + island), 3.0);
  EXPECT_EQ(p.samples.at(R"(pathways_client_weight{island="0",client="0123abcd"})"), 2.5);
  EXPECT_EQ(p.samples.at("pathways_live_clients"), 1.0);
  EXPECT_EQ(p.samples.at("pathways_slices"), 1.0);
  EXPECT_EQ(p.samples.at("pathways_slice_devices"), 2.0);
}

TEST(MetricsTest, HostCountersAndTheCollectiveLatencyHistogram) {
  const Parsed p = Parse(PrometheusText(TwoHostStatus()));
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

TEST(MetricsTest, AnEmptyClusterStillDeclaresItsFamilies) {
  const Parsed p = Parse(PrometheusText(rpc::ClusterStatus()));
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
