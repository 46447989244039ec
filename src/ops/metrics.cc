#include "ops/metrics.h"

#include <charconv>
#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pathways {

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

namespace {

using Labels = std::vector<std::pair<std::string, std::string>>;

// Exactly, and as short as that allows: StrCat's 6 significant digits would round byte counts
// and merge histogram bounds; %.17g would print 0.079 as 0.079000000000000001. Fixed notation:
// le="0.0001", not "1e-04".
std::string FormatValue(double v) {
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) return absl::StrCat(static_cast<int64_t>(v));
  char buf[64];
  const auto [end, error] = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed);
  return error == std::errc() ? std::string(buf, end) : absl::StrFormat("%.17g", v);
}

// Samples grouped by metric: the format wants each metric's samples together, after its HELP
// and TYPE lines.
class Exposition {
 public:
  void Define(const std::string& name, const std::string& type, const std::string& help) {
    order_.push_back(name);
    metrics_[name] = {type, help, {}};
  }
  void Add(const std::string& name, const Labels& labels, double value, const std::string& suffix = "") {
    std::string line = name + suffix;
    if (!labels.empty()) {
      line += "{";
      for (size_t i = 0; i < labels.size(); ++i) {
        absl::StrAppend(&line, i > 0 ? "," : "", labels[i].first, "=\"", EscapeLabelValue(labels[i].second), "\"");
      }
      line += "}";
    }
    absl::StrAppend(&line, " ", FormatValue(value), "\n");
    metrics_.at(name).samples += line;
  }
  std::string Text() const {
    std::string out;
    for (const std::string& name : order_) {
      const Metric& m = metrics_.at(name);
      absl::StrAppend(&out, "# HELP ", name, " ", m.help, "\n# TYPE ", name, " ", m.type, "\n", m.samples);
    }
    return out;
  }

 private:
  struct Metric {
    std::string type, help, samples;
  };
  std::vector<std::string> order_;
  std::map<std::string, Metric> metrics_;
};

// A histogram from per-bucket counts over bounds in microseconds (one bucket more than bounds,
// for what lies beyond them): the exposition's buckets are cumulative, in seconds, the last +Inf.
// Counts that do not fit their bounds (an older worker) give no samples.
template <typename Bounds, typename Buckets>
void AddHistogram(Exposition& e, const std::string& name, const Labels& labels, const Bounds& bounds_us,
                  const Buckets& buckets, int64_t sum_us) {
  if (buckets.size() != bounds_us.size() + 1) return;
  int64_t cumulative = 0;
  for (int i = 0; i < buckets.size(); ++i) {
    cumulative += buckets[i];
    Labels bucket = labels;
    bucket.emplace_back("le", i < bounds_us.size() ? FormatValue(bounds_us[i] / 1e6) : "+Inf");
    e.Add(name, bucket, static_cast<double>(cumulative), "_bucket");
  }
  e.Add(name, labels, static_cast<double>(sum_us) / 1e6, "_sum");
  e.Add(name, labels, static_cast<double>(cumulative), "_count");
}

// Each client's share of its island's device time over the status's timeline (the dashboard's
// measured share), by island and client label; empty without a timeline.
std::map<std::pair<int, std::string>, double> RecentShares(const rpc::ClusterStatus& status) {
  std::map<std::string, int> island_of;
  for (const rpc::HostStatus& h : status.hosts()) island_of[h.address()] = h.island();
  std::map<std::pair<int, std::string>, double> micros;
  std::map<int, double> island_micros;
  for (const rpc::DeviceTimeline& d : status.timeline().devices()) {
    auto island = island_of.find(d.host());
    if (island == island_of.end()) continue;
    for (const rpc::WorkBucket& b : d.buckets()) {
      for (const rpc::ClientTime& t : b.busy()) {
        micros[{island->second, t.client_id()}] += static_cast<double>(t.busy_micros());
        island_micros[island->second] += static_cast<double>(t.busy_micros());
      }
    }
  }
  for (auto& [key, value] : micros) value = island_micros[key.first] > 0 ? value / island_micros[key.first] : 0;
  return micros;
}

}  // namespace

// Every family served, in the order served: name, type, help.
constexpr struct {
  const char* name;
  const char* type;
  const char* help;
} kFamilies[] = {
    // clang-format off
    {"pathways_host_up", "gauge", "1 while the host heartbeats, else 0."},
    {"pathways_host_heartbeat_age_seconds", "gauge", "Time since the host's last heartbeat."},
    {"pathways_device_memory_used_bytes", "gauge", "Device memory in use, as of the last heartbeat."},
    {"pathways_device_memory_limit_bytes", "gauge", "The device's memory budget."},
    {"pathways_device_memory_peak_bytes", "gauge", "The most device memory in use at once since the worker started."},
    {"pathways_device_busy_seconds_total", "counter", "Time the device spent computing since the worker started."},
    {"pathways_device_computations_total", "counter", "Computations the device ran since the worker started."},
    {"pathways_device_client_busy_seconds_total", "counter", "Device time per client since the worker started (its share is this over the device's busy time)."},
    {"pathways_host_blocks_sent_total", "counter", "Blocks of arrays the host sent to other hosts and they landed."},
    {"pathways_host_blocks_received_total", "counter", "Blocks of arrays the host received from other hosts."},
    {"pathways_host_block_sent_bytes_total", "counter", "Bytes of the blocks the host sent to other hosts."},
    {"pathways_host_block_received_bytes_total", "counter", "Bytes of the blocks the host received from other hosts."},
    {"pathways_host_dataflow_sent_bytes_total", "counter", "Payload bytes of the dataflow messages the host sent."},
    {"pathways_host_dataflow_received_bytes_total", "counter", "Payload bytes of the dataflow messages the host received."},
    {"pathways_host_collectives_total", "counter", "Collective calls of the host's devices (one per member)."},
    {"pathways_host_collective_failures_total", "counter", "Collective calls of the host's devices that failed."},
    {"pathways_host_collective_latency_seconds", "histogram", "Time from a member's collective call until its output is written, waiting for the group included."},
    {"pathways_host_runs_in_flight", "gauge", "Runs set up on the host whose shards there are not all done, as of the last heartbeat."},
    {"pathways_host_collectives_in_progress", "gauge", "Member calls of the host's devices inside a collective (waiting for their group included), as of the last heartbeat."},
    {"pathways_host_compiled_functions", "gauge", "Compiled functions the host keeps for its clients, as of the last heartbeat."},
    {"pathways_host_compiled_bytes", "gauge", "What the compiled functions kept on the host are charged (graphs, folded constants, their entries), as of the last heartbeat."},
    {"pathways_scheduler_rounds_total", "counter", "Scheduling rounds sent to the island's hosts."},
    {"pathways_scheduler_released_runs_total", "counter", "Runs the island scheduler released to its hosts."},
    {"pathways_scheduler_release_wait_seconds", "histogram", "Time runs waited at the island scheduler between submission and release."},
    {"pathways_scheduler_queued_runs", "gauge", "Runs submitted and not yet released."},
    {"pathways_scheduler_outstanding_runs", "gauge", "Proportional share: runs released and not yet reported done."},
    {"pathways_scheduler_runs_in_flight", "gauge", "Runs in flight on the island's hosts, as its busiest live host counts them (under FIFO runs wait on the devices, not at the scheduler)."},
    {"pathways_client_weight", "gauge", "The client's stated share weight at the island scheduler."},
    {"pathways_client_device_share", "gauge", "The client's share of the island's device time over the last seconds (the dashboard's window); clients without recent work have none."},
    {"pathways_client_queued_runs", "gauge", "The client's runs waiting at the island scheduler."},
    {"pathways_client_released_runs_total", "counter", "The client's runs the island scheduler released."},
    {"pathways_client_failed_shards_total", "counter", "Shards of the client's runs that failed on the host (inputs lost, refused, out of memory, a failed collective, ...)."},
    {"pathways_live_clients", "gauge", "Clients whose lease holds."},
    {"pathways_slices", "gauge", "Virtual slices allocated."},
    {"pathways_slice_devices", "gauge", "Devices the allocated slices map to, counted once per slice."},
    // clang-format on
};

std::string PrometheusText(const rpc::ClusterStatus& status) {
  Exposition e;
  for (const auto& f : kFamilies) e.Define(f.name, f.type, f.help);

  for (const rpc::HostStatus& h : status.hosts()) {
    const Labels host = {{"host", h.address()}, {"island", absl::StrCat(h.island())}};
    e.Add("pathways_host_up", host, h.alive() ? 1 : 0);
    e.Add("pathways_host_heartbeat_age_seconds", host, static_cast<double>(h.millis_since_heartbeat()) / 1e3);
    const rpc::HostCounters& c = h.counters();
    e.Add("pathways_host_blocks_sent_total", host, static_cast<double>(c.blocks_sent()));
    e.Add("pathways_host_blocks_received_total", host, static_cast<double>(c.blocks_received()));
    e.Add("pathways_host_block_sent_bytes_total", host, static_cast<double>(c.block_bytes_sent()));
    e.Add("pathways_host_block_received_bytes_total", host, static_cast<double>(c.block_bytes_received()));
    e.Add("pathways_host_dataflow_sent_bytes_total", host, static_cast<double>(c.dataflow_bytes_sent()));
    e.Add("pathways_host_dataflow_received_bytes_total", host, static_cast<double>(c.dataflow_bytes_received()));
    e.Add("pathways_host_collectives_total", host, static_cast<double>(c.collectives()));
    e.Add("pathways_host_collective_failures_total", host, static_cast<double>(c.collectives_failed()));
    AddHistogram(e, "pathways_host_collective_latency_seconds", host, c.latency_bounds_us(), c.latency_buckets(),
                 c.latency_sum_us());
    e.Add("pathways_host_runs_in_flight", host, static_cast<double>(c.runs_in_flight()));
    e.Add("pathways_host_collectives_in_progress", host, static_cast<double>(c.collectives_in_progress()));
    e.Add("pathways_host_compiled_functions", host, static_cast<double>(c.compiled_functions()));
    e.Add("pathways_host_compiled_bytes", host, static_cast<double>(c.compiled_bytes()));
    for (const rpc::ClientCount& f : c.failed_shards()) {
      Labels client = host;
      client.emplace_back("client", f.client_id());
      e.Add("pathways_client_failed_shards_total", client, static_cast<double>(f.count()));
    }
    for (const rpc::DeviceInfo& d : h.devices()) {
      Labels device = host;
      device.emplace_back("device", absl::StrCat(d.device_id()));
      device.emplace_back("kind", d.kind());
      e.Add("pathways_device_memory_used_bytes", device, static_cast<double>(d.memory_used()));
      e.Add("pathways_device_memory_limit_bytes", device, static_cast<double>(d.memory_capacity()));
      e.Add("pathways_device_memory_peak_bytes", device, static_cast<double>(d.memory_peak()));
      e.Add("pathways_device_busy_seconds_total", device, static_cast<double>(d.busy_micros()) / 1e6);
      e.Add("pathways_device_computations_total", device, static_cast<double>(d.executed()));
      for (const rpc::ClientTime& t : d.client_time()) {
        Labels client = device;
        client.emplace_back("client", t.client_id());
        e.Add("pathways_device_client_busy_seconds_total", client, static_cast<double>(t.busy_micros()) / 1e6);
      }
    }
  }
  const std::map<std::pair<int, std::string>, double> shares = RecentShares(status);
  for (const rpc::SchedulerStatus& s : status.schedulers()) {
    const Labels island = {{"island", absl::StrCat(s.island())}, {"policy", s.policy()}};
    e.Add("pathways_scheduler_rounds_total", island, static_cast<double>(s.rounds()));
    e.Add("pathways_scheduler_released_runs_total", island, static_cast<double>(s.released_runs()));
    AddHistogram(e, "pathways_scheduler_release_wait_seconds", island, s.release_wait_bounds_us(),
                 s.release_wait_buckets(), s.release_wait_us_sum());
    int64_t queued = 0;
    for (const rpc::SchedulerClientStatus& c : s.clients()) queued += c.queued_runs();
    e.Add("pathways_scheduler_queued_runs", island, static_cast<double>(queued));
    e.Add("pathways_scheduler_outstanding_runs", island, static_cast<double>(s.outstanding_runs()));
    e.Add("pathways_scheduler_runs_in_flight", island, static_cast<double>(s.runs_in_flight()));
    for (const rpc::SchedulerClientStatus& c : s.clients()) {
      Labels client = {{"island", absl::StrCat(s.island())}, {"client", c.client_id()}};
      if (!c.tenant().empty()) client.push_back({"tenant", c.tenant()});
      e.Add("pathways_client_weight", client, c.weight());
      if (auto share = shares.find({s.island(), c.client_id()}); share != shares.end()) {
        e.Add("pathways_client_device_share", client, share->second);
      }
      e.Add("pathways_client_queued_runs", client, static_cast<double>(c.queued_runs()));
      e.Add("pathways_client_released_runs_total", client, static_cast<double>(c.released_runs()));
    }
  }
  e.Add("pathways_live_clients", {}, static_cast<double>(status.live_clients()));
  int64_t mapped = 0;
  for (const rpc::SliceStatus& s : status.slices()) mapped += s.device_ids_size();
  e.Add("pathways_slices", {}, status.slices_size());
  e.Add("pathways_slice_devices", {}, static_cast<double>(mapped));
  return e.Text();
}

}  // namespace pathways
