// Multi-tenancy (paper §5.2) on an embedded cluster: Figure 8's aggregate throughput and device
// utilisation as concurrent clients grow, and Figure 9's shares of device time under
// proportional share. Prints markdown tables; see docs/benchmarks.md.
//
//   build/bin/multitenancy_bench [--seconds S] [--repeats R] [--max-clients N] [--trace-prefix P]
//                                [--hosts H] [--sim-cost-us C]
//
// By default one host of two CPU devices (one per core of the development machine). With
// --sim-cost-us, H hosts of two simulated devices each (every mechanism real, each run's kernel a
// modelled C us: compute/modelled_executable.h), so the paper's 4-host shape runs on two cores.
//
// With --trace-prefix, writes one Chrome trace per Figure 9 weighting (P1111.json, P1248.json)
// and one per Figure 8 client count (Pclients_1.json, Pclients_2.json, ...): 30 ms of every
// tenant's work, for tools/plot_trace.py and Figure 11 (`tools/plot_figures.py fig11 P`).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <thread>

#include "bench_util.h"
#include "absl/strings/str_split.h"
#include "cluster/local_cluster.h"
#include "core/process.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::Median;

constexpr int kDevicesPerHost = 2;  // one device per core of the machine
constexpr int kOutstanding = 8;  // runs each client keeps in flight for Figure 8
// For Figure 9 every client must always have runs waiting at the scheduler, or it cannot be
// given its share: more in flight than the scheduler's window holds.
constexpr int kOutstandingForShares = 32;
constexpr int64_t kSide = 160;   // a 160x160 matmul: ~0.3 ms of device work here
// Figure 9 uses longer runs (~1 ms): every client thread must keep its backlog at the scheduler
// full, and with ~0.3 ms runs the busiest client needs ~1400 calls a second from a process that
// shares this machine's 2 cores with the devices; it then falls behind and, correctly, gets less
// than its share (the scheduler is work-conserving).
constexpr int64_t kSideForShares = 256;

// One client running a gang program (matmul, tanh, all_reduce over both devices) in a closed
// loop with kOutstanding runs in flight.
struct Tenant {
  std::unique_ptr<Client> client;
  VirtualSlice slice;
  CompiledFunction fn;
  ShardedArray x;
  std::atomic<int64_t> completed{0};
};

// The cluster every table runs on: one host of CPU devices, or several of simulated ones.
struct TenancyShape {
  int hosts = 1;
  int64_t sim_cost_us = 0;  // 0: CPU devices
  int devices() const { return hosts * kDevicesPerHost; }
  LocalClusterOptions Options() const {
    LocalClusterOptions options{.num_islands = 1, .hosts_per_island = hosts, .devices_per_host = kDevicesPerHost,
                                .device_memory_bytes = int64_t{256} << 20};
    if (sim_cost_us > 0) options.backend = *DeviceBackend::Create("sim", absl::StrCat("*=", sim_cost_us));
    return options;
  }
};

std::unique_ptr<Tenant> NewTenant(const LocalCluster& cluster, const TenancyShape& shape, int index, double weight,
                                  int64_t side) {
  auto t = std::make_unique<Tenant>();
  t->client = *Client::Connect(cluster.controller_address(), {.weight = weight});
  t->slice = *t->client->CreateSlice({.mesh_shape = {shape.devices()}});
  const TensorSpec spec{DType::kF32, {side, side}};
  const std::string name = absl::StrCat("tenant", index);
  t->fn = *t->client->Compile(FunctionSpec::Script(
      name, absl::StrCat("def ", name, "(x):\n    return pathways.all_reduce(torch.tanh(x @ x), 'x', 'mean')\n"),
      {spec}, {spec}, {{}}, {{}}));
  HostArray data = *HostArray::Create(DType::kF32, {side, side});
  for (int64_t i = 0; i < side * side; ++i) data.mutable_data<float>()[i] = 0.01f * static_cast<float>(i % 7);
  t->x = *t->client->Put(data, t->slice, {});
  return t;
}

void Drive(Tenant& t, int outstanding, const std::atomic<bool>& stop) {
  std::deque<ShardedArray> in_flight;
  while (!stop.load()) {
    if (static_cast<int>(in_flight.size()) == outstanding) {
      if (!t.client->Ready(in_flight.front()).Await().ok()) std::exit(1);
      in_flight.pop_front();
      t.completed.fetch_add(1);
    }
    in_flight.push_back((*t.client->Call(t.fn, t.slice, {t.x}))[0]);
  }
  for (auto& a : in_flight) (void)t.client->Ready(a).Await();
}

std::map<std::string, int64_t> BusyByClient(LocalCluster& cluster) {
  std::map<std::string, int64_t> busy;
  for (int w = 0; w < cluster.num_workers(); ++w) {
    for (int d = 0; d < kDevicesPerHost; ++d) {
      for (const auto& [client, us] : cluster.worker(w).runtime().device(d).stats().busy_micros_by_client) {
        busy[client] += us;
      }
    }
  }
  return busy;
}

struct Measured {
  double runs_per_second;
  double utilisation;              // device time used / device time available
  std::vector<double> share;       // per tenant, of the device time used
  double device_ms_per_run;
};

// Runs the tenants for `seconds` after a warm-up and measures. With `trace_path`, also writes 30
// ms of every tenant's work as one Chrome trace.
Measured RunTenants(LocalCluster& cluster, const TenancyShape& shape, std::vector<std::unique_ptr<Tenant>>& tenants,
                    int outstanding, double seconds, const std::string& trace_path) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (auto& t : tenants) threads.emplace_back([&t, outstanding, &stop] { Drive(*t, outstanding, stop); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // warm-up: queues fill, costs settle
  auto busy0 = BusyByClient(cluster);
  std::vector<int64_t> done0;
  for (auto& t : tenants) done0.push_back(t->completed.load());
  auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto busy1 = BusyByClient(cluster);
  std::vector<int64_t> done1;
  for (auto& t : tenants) done1.push_back(t->completed.load());
  const absl::Time trace_until = absl::Now();
  const absl::Time trace_since = trace_until - absl::Milliseconds(30);
  stop.store(true);
  for (auto& th : threads) th.join();

  Measured m{};
  int64_t runs = 0, total_busy = 0;
  std::vector<int64_t> busy;
  for (size_t i = 0; i < tenants.size(); ++i) {
    const std::string& id = tenants[i]->client->id();
    busy.push_back(busy1[id] - busy0[id]);
    total_busy += busy.back();
    runs += done1[i] - done0[i];
  }
  for (int64_t b : busy) m.share.push_back(total_busy > 0 ? static_cast<double>(b) / total_busy : 0);
  m.runs_per_second = runs / elapsed;
  m.utilisation = total_busy / (elapsed * 1e6 * shape.devices());
  m.device_ms_per_run = runs > 0 ? total_busy / 1e3 / shape.devices() / runs : 0;
  if (!trace_path.empty()) {
    // Each tenant sees only its own work; one file with all of them shows how they interleave.
    std::string events;
    for (auto& t : tenants) {
      std::string json = *t->client->TraceJson(trace_since);
      const size_t begin = json.find('[') + 1, end = json.rfind(']');
      // One event per line; leave out work that started after the measured window (the drain).
      for (absl::string_view line : absl::StrSplit(json.substr(begin, end - begin), ",\n", absl::SkipWhitespace())) {
        const size_t ts = line.find("\"ts\":");
        if (ts != absl::string_view::npos &&
            std::strtoll(std::string(line.substr(ts + 5)).c_str(), nullptr, 10) > absl::ToUnixMicros(trace_until)) {
          continue;
        }
        absl::StrAppend(&events, events.empty() ? "" : ",\n", line);
      }
    }
    std::ofstream(trace_path) << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[" << events << "]}\n";
  }
  return m;
}

// What every run's kernel is, for the tables' captions.
std::string Work(const TenancyShape& shape, int64_t side) {
  if (shape.sim_cost_us > 0) {
    return absl::StrCat("a modelled ", shape.sim_cost_us, " us kernel and a rendezvous of the gang, on ",
                        shape.devices(), " simulated devices over ", shape.hosts, " hosts");
  }
  return absl::StrCat("a ", side, "x", side, " matmul, tanh and an all_reduce, on both CPU devices of one host");
}

void ThroughputTable(const TenancyShape& shape, int max_clients, int repeats, double seconds, const std::string& trace_prefix) {
  std::printf("### Figure 8: aggregate throughput as clients grow (FIFO scheduler, median of %d)\n\n", repeats);
  std::printf("Every client runs a gang program over every device (%s), keeping %d runs in flight.\n\n",
              Work(shape, kSide).c_str(), kOutstanding);
  std::printf("| clients | runs/s (all clients) | device utilisation | device ms per run |\n|---|---|---|---|\n");
  const std::vector<int> counts = bench::Doublings(max_clients);
  bench::RowProgress progress("Figure 8", static_cast<int64_t>(counts.size()));
  for (int n : counts) {
    progress.Measuring(absl::StrCat(n, " clients"));
    std::vector<double> rate, util, per_run;
    for (int r = 0; r < repeats; ++r) {
      auto cluster = *LocalCluster::Start(shape.Options());
      std::vector<std::unique_ptr<Tenant>> tenants;
      for (int i = 0; i < n; ++i) tenants.push_back(NewTenant(*cluster, shape, i, 1.0, kSide));
      const std::string trace = r == 0 && !trace_prefix.empty() ? absl::StrCat(trace_prefix, "clients_", n, ".json") : "";
      Measured m = RunTenants(*cluster, shape, tenants, kOutstanding, seconds, trace);
      rate.push_back(m.runs_per_second);
      util.push_back(m.utilisation);
      per_run.push_back(m.device_ms_per_run);
    }
    progress.Printing();
    std::printf("| %d | %.0f | %.0f%% | %.3f |\n", n, Median(rate), 100 * Median(util), Median(per_run));
  }
  std::printf("\n");
}

void SharesTable(const TenancyShape& shape, const std::vector<double>& weights, int repeats, double seconds,
                 const std::string& trace_path) {
  std::string label;
  for (double w : weights) absl::StrAppend(&label, label.empty() ? "" : ":", static_cast<int>(w));
  double total_weight = 0;
  for (double w : weights) total_weight += w;
  std::vector<std::vector<double>> shares(weights.size());
  std::vector<double> util;
  bench::RowProgress progress(absl::StrCat("Figure 9, weights ", label), repeats);
  for (int r = 0; r < repeats; ++r) {
    progress.Measuring(absl::StrCat("repeat ", r + 1));
    LocalClusterOptions options = shape.Options();
    options.scheduler.policy = SchedulingPolicy::kProportionalShare;
    auto cluster = *LocalCluster::Start(options);
    std::vector<std::unique_ptr<Tenant>> tenants;
    for (size_t i = 0; i < weights.size(); ++i) {
      tenants.push_back(NewTenant(*cluster, shape, static_cast<int>(i), weights[i], kSideForShares));
    }
    Measured m = RunTenants(*cluster, shape, tenants, kOutstandingForShares, seconds, r == 0 ? trace_path : "");
    for (size_t i = 0; i < weights.size(); ++i) shares[i].push_back(m.share[i]);
    util.push_back(m.utilisation);
  }
  progress.Printing();
  std::printf("#### Weights %s (each run %s; device utilisation %.0f%%)\n\n", label.c_str(),
              Work(shape, kSideForShares).c_str(), 100 * Median(util));
  std::printf("| client | weight | target share | measured share | measured / target |\n|---|---|---|---|---|\n");
  for (size_t i = 0; i < weights.size(); ++i) {
    const double target = weights[i] / total_weight, got = Median(shares[i]);
    std::printf("| tenant%zu | %d | %.1f%% | %.1f%% | %.3f |\n", i, static_cast<int>(weights[i]), 100 * target,
                100 * got, got / target);
  }
  std::printf("\n");
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) {
  using namespace pathways;
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"seconds", "repeats", "max-clients", "trace-prefix", "hosts", "sim-cost-us"});
  const double seconds = static_cast<double>(bench::IntFlagOrExit(flags, "seconds", 2));
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 3));
  const int max_clients = static_cast<int>(bench::IntFlagOrExit(flags, "max-clients", 16, 1, 64));
  const std::string prefix = flags.Get("trace-prefix");
  const TenancyShape shape{.hosts = static_cast<int>(bench::IntFlagOrExit(flags, "hosts", 1, 1, 64)),
                    .sim_cost_us = bench::IntFlagOrExit(flags, "sim-cost-us", 0, 0, 1000000)};
  if (shape.hosts > 1 && shape.sim_cost_us == 0) {
    // More CPU devices than the machine has cores would measure the cores, not the runtime.
    std::fprintf(stderr, "--hosts above 1 needs --sim-cost-us (simulated devices)\n");
    return 2;
  }
  ThroughputTable(shape, max_clients, repeats, seconds, prefix);
  std::printf("### Figure 9: shares of device time under proportional share (median of %d)\n\n", repeats);
  SharesTable(shape, {1, 1, 1, 1}, repeats, seconds, prefix.empty() ? "" : prefix + "1111.json");
  SharesTable(shape, {1, 2, 4, 8}, repeats, seconds, prefix.empty() ? "" : prefix + "1248.json");
  return 0;
}
