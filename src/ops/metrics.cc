#include "ops/metrics.h"

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

// Exactly: StrCat's 6 significant digits would round byte counts.
std::string FormatValue(double v) {
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) return absl::StrCat(static_cast<int64_t>(v));
  return absl::StrFormat("%.17g", v);
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

}  // namespace

// Every family served, in the order served: name, type, help.
constexpr struct {
  const char* name;
  const char* type;
  const char* help;
} kFamilies[] = {
    {"pathways_host_up", "gauge", "1 while the host heartbeats, else 0."},
    {"pathways_host_heartbeat_age_seconds", "gauge", "Time since the host's last heartbeat."},
    {"pathways_device_memory_used_bytes", "gauge", "Device memory in use, as of the last heartbeat."},
    {"pathways_device_memory_limit_bytes", "gauge", "The device's memory budget."},
    {"pathways_device_memory_peak_bytes", "gauge", "The most device memory in use at once since the worker started."},
    {"pathways_device_busy_seconds_total", "counter", "Time the device spent computing since the worker started."},
    {"pathways_device_computations_total", "counter", "Computations the device ran since the worker started."},
    {"pathways_device_client_busy_seconds_total", "counter", "Device time per client since the worker started (its share is this over the device's busy time)."},
    {"pathways_scheduler_rounds_total", "counter", "Scheduling rounds sent to the island's hosts."},
    {"pathways_scheduler_released_runs_total", "counter", "Runs the island scheduler released to its hosts."},
    {"pathways_scheduler_release_wait_seconds", "summary", "Time runs waited at the island scheduler between submission and release."},
    {"pathways_scheduler_queued_runs", "gauge", "Runs submitted and not yet released."},
    {"pathways_scheduler_outstanding_runs", "gauge", "Proportional share: runs released and not yet reported done."},
    {"pathways_client_weight", "gauge", "The client's stated share weight at the island scheduler."},
    {"pathways_client_queued_runs", "gauge", "The client's runs waiting at the island scheduler."},
    {"pathways_client_released_runs_total", "counter", "The client's runs the island scheduler released."},
    {"pathways_live_clients", "gauge", "Clients whose lease holds."},
    {"pathways_slices", "gauge", "Virtual slices allocated."},
    {"pathways_slice_devices", "gauge", "Devices the allocated slices map to, counted once per slice."},
};

std::string PrometheusText(const rpc::ClusterStatus& status) {
  Exposition e;
  for (const auto& f : kFamilies) e.Define(f.name, f.type, f.help);

  for (const rpc::HostStatus& h : status.hosts()) {
    const Labels host = {{"host", h.address()}, {"island", absl::StrCat(h.island())}};
    e.Add("pathways_host_up", host, h.alive() ? 1 : 0);
    e.Add("pathways_host_heartbeat_age_seconds", host, static_cast<double>(h.millis_since_heartbeat()) / 1e3);
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
  for (const rpc::SchedulerStatus& s : status.schedulers()) {
    const Labels island = {{"island", absl::StrCat(s.island())}, {"policy", s.policy()}};
    e.Add("pathways_scheduler_rounds_total", island, static_cast<double>(s.rounds()));
    e.Add("pathways_scheduler_released_runs_total", island, static_cast<double>(s.released_runs()));
    e.Add("pathways_scheduler_release_wait_seconds", island, static_cast<double>(s.release_wait_us_sum()) / 1e6, "_sum");
    e.Add("pathways_scheduler_release_wait_seconds", island, static_cast<double>(s.released_runs()), "_count");
    int64_t queued = 0;
    for (const rpc::SchedulerClientStatus& c : s.clients()) queued += c.queued_runs();
    e.Add("pathways_scheduler_queued_runs", island, static_cast<double>(queued));
    e.Add("pathways_scheduler_outstanding_runs", island, static_cast<double>(s.outstanding_runs()));
    for (const rpc::SchedulerClientStatus& c : s.clients()) {
      const Labels client = {{"island", absl::StrCat(s.island())}, {"client", c.client_id()}};
      e.Add("pathways_client_weight", client, c.weight());
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
