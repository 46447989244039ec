// The single controller at the paper's scale (issue 14 item 4): a real controller process and
// worker processes holding many hosts each, on simulated devices (device kind sim: every mechanism
// real, kernels replaced by modelled durations), driven by a real client in this process. For
// slices over 1 to --max-hosts hosts of --devices devices each, prints:
//  - the time to create the slice, and to lower, register and enqueue a 128-node chain on it;
//  - Chained throughput of the chain's modelled computations (--cost-us each) against the
//    modelled devices' limit (one computation at a time along the chain), and the hosts' own CPU
//    per computation (the worker processes', less what they take idle): with it, the cores a host
//    needs to keep its devices at the limit, which on a real cluster each host has for itself;
//  - per run of a one-node program at cost 0, pipelined: runs per second end to end (what the
//    island's gang scheduler and the control graph sustain), the client's and the controller's
//    CPU time, and the bytes of the run's message from the client;
//  - the controller's and the workers' memory and threads.
//
//   build/bin/scale_bench [--max-hosts 512] [--hosts-per-process 64] [--devices 4] [--cost-us 1000]
//                         [--runs 1000] [--chains 4]
//
// Every process it starts is stopped when it ends, and killed if it is itself killed
// (Subprocess::KillWhenParentEnds).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_util.h"
#include "chain.h"
#include "client/client.h"
#include "client/program.h"
#include "core/process.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::ProcessCpuSeconds;
using bench::Seconds;
using bench::SelfCpuSeconds;
using bench::ThreadCpuSeconds;

constexpr int kChain = 128;

// A field of /proc/PID/status ("VmRSS", "Threads") as its number (kB for sizes).
int64_t StatusField(pid_t pid, const std::string& name) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + ":", 0) == 0) return std::stoll(line.substr(name.size() + 1));
  }
  return 0;
}

void Die(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "scale_bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Must(absl::StatusOr<T> value, const std::string& what) {
  if (!value.ok()) Die(what, value.status());
  return *std::move(value);
}

int Run(const Flags& flags) {
  const int64_t max_hosts = bench::IntFlagOrExit(flags, "max-hosts", 512);
  const int64_t per_process = bench::IntFlagOrExit(flags, "hosts-per-process", 64);
  const int64_t devices = bench::IntFlagOrExit(flags, "devices", 4);
  const int64_t cost_us = bench::IntFlagOrExit(flags, "cost-us", 1000, /*min=*/0);
  const int64_t runs = bench::IntFlagOrExit(flags, "runs", 1000);
  const int64_t chains = bench::IntFlagOrExit(flags, "chains", 4);
  // Hundreds of hosts on a few cores starve processes for seconds under load, which is not the
  // failure keepalives, heartbeats and client leases are there to catch: all three get generous
  // timeouts (the children inherit the environment).
  setenv("PATHWAYS_KEEPALIVE_MS", "30000", /*overwrite=*/0);
  Subprocess controller;
  controller.KillWhenParentEnds();
  const std::string address = Must(StartController(controller, {PATHWAYS_BINARY, "controller", "--listen",
                                                                 "127.0.0.1:0", "--heartbeat-timeout-ms", "60000",
                                                                 "--client-timeout-ms", "60000"}),
                                   "starting the controller");
  std::vector<std::unique_ptr<Subprocess>> workers;
  const absl::Time started = absl::Now();
  for (int64_t placed = 0; placed < max_hosts; placed += per_process) {
    const int64_t hosts = std::min(per_process, max_hosts - placed);
    auto w = std::make_unique<Subprocess>();
    w->KillWhenParentEnds();
    absl::Status s = w->Start({PATHWAYS_BINARY, "worker", "--controller", address, "--hosts", absl::StrCat(hosts),
                               "--devices", absl::StrCat(devices), "--device-kind", "sim", "--sim-cost-us",
                               absl::StrCat("add_one=", cost_us, ",*=0"), "--device-memory", "64MiB",
                               "--collective-timeout-ms", "120000"});
    if (!s.ok()) Die("starting a worker process", s);
    for (int64_t h = 0; h < hosts; ++h) {
      if (auto line = w->WaitForLine("serving", absl::Minutes(5)); !line.ok()) Die("a worker's hosts starting", line.status());
    }
    workers.push_back(std::move(w));
  }
  std::printf("### The controller at scale: %lld hosts of %lld simulated devices in %zu worker processes "
              "(started in %.1f s)\n\n",
              static_cast<long long>(max_hosts), static_cast<long long>(devices), workers.size(),
              absl::ToDoubleSeconds(absl::Now() - started));
  std::fflush(stdout);
  auto workers_cpu = [&] {
    double sum = 0;
    for (const auto& w : workers) sum += ProcessCpuSeconds(w->pid());
    return sum;
  };
  // What the hosts cost doing nothing (heartbeats, pollers), taken off the chains' CPU below.
  const double idle0 = workers_cpu();
  absl::SleepFor(absl::Seconds(2));
  const double idle_rate = (workers_cpu() - idle0) / 2;
  std::printf("Idle, the worker processes take %.1f ms of CPU a second (%.0f us a host).\n\n", idle_rate * 1e3,
              idle_rate * 1e6 / static_cast<double>(max_hosts));
  auto client = Must(Client::Connect(address), "connecting");
  std::printf("Chained: a %d-node chain of `add_one`, %lld us modelled per computation, run %lld times; limit "
              "%.0f computations/s. Per run: %lld pipelined runs of a one-node program at cost 0 (a "
              "`negate`).\n\n",
              kChain, static_cast<long long>(cost_us), static_cast<long long>(chains),
              cost_us > 0 ? 1e6 / static_cast<double>(cost_us) : 0.0, static_cast<long long>(runs));
  std::printf(
      "| hosts | shards | create slice ms | lower + register + enqueue chain ms | Chained computations/s "
      "| of limit | worker CPU us/computation | host cores at the limit | runs/s | client CPU us/run (calling thread) "
      "| controller CPU us/run | run message bytes | controller RSS MiB |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<int64_t> sizes;
  for (int64_t n = 1; n < max_hosts; n *= 4) sizes.push_back(n);
  sizes.push_back(max_hosts);
  bench::RowProgress progress("measured", static_cast<int64_t>(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t hosts = sizes[i];
    const int64_t shards = hosts * devices;
    progress.Measuring(
        absl::StrFormat("%lld hosts, %lld shards", static_cast<long long>(hosts), static_cast<long long>(shards)));
    VirtualSlice slice;
    const double t_slice = Seconds([&] { slice = Must(client->CreateSlice({.mesh_shape = {shards}}), "a slice"); });
    const TensorSpec spec{DType::kF32, {shards}};
    CompiledFunction inc =
        Must(client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}})), "add_one");
    CompiledFunction neg =
        Must(client->Compile(FunctionSpec::Builtin("negate", {spec}, {spec}, {{"x"}}, {{"x"}})), "negate");
    Program chain = Must(bench::ChainOf(absl::StrCat("chain", hosts), inc, slice, spec, kChain), "building the chain");
    ShardedArray x = Must(client->Put(Must(HostArray::Create(DType::kF32, {shards}), "array"), slice, {"x"}), "put");
    const double t_lower = Seconds([&] {
      x = Must(client->Run(chain, {x}), "the first chain")[0];
      if (auto s = client->Enqueued(x).Await(); !s.ok()) Die("the first chain", s.status());
    });
    if (auto s = client->Ready(x).Await(); !s.ok()) Die("the first chain", s.status());
    const double chained_cpu0 = workers_cpu();
    const double t_chained = Seconds([&] {
      for (int64_t c = 0; c < chains; ++c) x = Must(client->Run(chain, {x}), "a chain")[0];
      if (auto s = client->Ready(x).Await(); !s.ok()) Die("the chains", s.status());
    });
    const double chained_rate = static_cast<double>(kChain * chains) / t_chained;
    const double limit = cost_us > 0 ? 1e6 / static_cast<double>(cost_us) : 0;
    // The hosts' own CPU per modelled computation (every thread of theirs, idle work aside), and
    // so the cores a host of `devices` devices needs to keep them at the limit: on a real cluster
    // each host has its own; here every host shares the machine's.
    const double computations = static_cast<double>(kChain * chains * shards);
    const double cpu_per_computation =
        std::max(0.0, workers_cpu() - chained_cpu0 - idle_rate * t_chained) / computations;
    const double host_cores = cpu_per_computation * static_cast<double>(devices) * limit;

    x = Must(client->Call(neg, slice, {x}), "warming the one-node program")[0];
    if (auto s = client->Ready(x).Await(); !s.ok()) Die("the one-node program", s.status());
    const ClientStats before = client->stats();
    // The controller's CPU is read first: reading it (a file per controller thread, a thousand
    // at 512 hosts) is the client's work, but not a run's.
    const double controller_cpu0 = ProcessCpuSeconds(controller.pid());
    const double client_cpu0 = SelfCpuSeconds(), caller_cpu0 = ThreadCpuSeconds();
    double client_cpu = 0, caller_cpu = 0;
    const double t_runs = Seconds([&] {
      for (int64_t r = 0; r < runs; ++r) x = Must(client->Call(neg, slice, {x}), "a run")[0];
      // The client's work per run is counted until the last run is on its hosts: the wait for its
      // result that follows asks every host once, a cost of the wait, not of the runs.
      if (auto s = client->Enqueued(x).Await(); !s.ok()) Die("the runs", s.status());
      client_cpu = SelfCpuSeconds() - client_cpu0;
      caller_cpu = ThreadCpuSeconds() - caller_cpu0;
      if (auto s = client->Ready(x).Await(); !s.ok()) Die("the runs", s.status());
    });
    const double controller_cpu = ProcessCpuSeconds(controller.pid()) - controller_cpu0;
    const ClientStats after = client->stats();
    const double run_bytes = static_cast<double>(after.run_op_bytes_sent - before.run_op_bytes_sent) /
                             static_cast<double>(std::max<int64_t>(1, after.run_ops_sent - before.run_ops_sent));
    progress.Printing();
    std::printf("| %lld | %lld | %.1f | %.1f | %.0f | %.2f | %.1f | %.2f | %.0f | %.1f (%.1f) | %.1f | %.0f | %.0f |\n",
                static_cast<long long>(hosts), static_cast<long long>(shards), t_slice * 1e3, t_lower * 1e3,
                chained_rate, limit > 0 ? chained_rate / limit : 0.0, cpu_per_computation * 1e6, host_cores,
                static_cast<double>(runs) / t_runs, client_cpu * 1e6 / static_cast<double>(runs),
                caller_cpu * 1e6 / static_cast<double>(runs), controller_cpu * 1e6 / static_cast<double>(runs),
                run_bytes, static_cast<double>(StatusField(controller.pid(), "VmRSS")) / 1024);
    std::fflush(stdout);
  }
  progress.Finished();
  int64_t worker_rss_kb = 0, worker_threads = 0;
  for (const auto& w : workers) {
    worker_rss_kb += StatusField(w->pid(), "VmRSS");
    worker_threads += StatusField(w->pid(), "Threads");
  }
  std::printf("\nController: %lld threads, %.0f MiB. Worker processes: %lld threads and %.0f MiB in all (%.1f "
              "threads, %.1f MiB per host).\n",
              static_cast<long long>(StatusField(controller.pid(), "Threads")),
              static_cast<double>(StatusField(controller.pid(), "VmRSS")) / 1024,
              static_cast<long long>(worker_threads), static_cast<double>(worker_rss_kb) / 1024,
              static_cast<double>(worker_threads) / static_cast<double>(max_hosts),
              static_cast<double>(worker_rss_kb) / 1024 / static_cast<double>(max_hosts));
  client.reset();
  controller.Terminate(absl::Seconds(30));  // first, so that it does not reach for hosts already gone
  for (auto& w : workers) w->Terminate(absl::Seconds(30));
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) {
  pathways::InitServingProcess();  // the client here is measured as a serving process runs it
  const pathways::Flags flags = pathways::bench::FlagsOrExit(
      argc, argv, {"max-hosts", "hosts-per-process", "devices", "cost-us", "runs", "chains"});
  return pathways::Run(flags);
}
