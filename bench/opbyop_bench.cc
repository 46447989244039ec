// Per-call time of a trivial compiled function (add_one on f32[1]) called OpByOp: one client call
// per computation, on an embedded cluster and on real processes over loopback. Prints a markdown
// table; see docs/benchmarks.md for results.
//
//   build/bin/opbyop_bench [--calls N] [--repeats R] [--devices D] [--threads true]
//
// With --threads, also what each thread of the client, controller and worker processes ran and
// waited for a core per call + Fetch (schedstat).
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_util.h"
#include "cluster/local_cluster.h"
#include "compute/executable.h"
#include "compute/function_cache.h"
#include "core/process.h"
#include "device/cpu_device.h"
#include "proto/pathways.grpc.pb.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::Median;

double MicrosPer(int64_t n, const std::function<void()>& body) {
  return bench::Seconds(body) * 1e6 / static_cast<double>(n);
}

struct Figures {
  double pipelined_us;   // N dependent calls issued back to back, one fetch at the end
  double round_trip_us;  // call, then wait for the result to be computed, N/10 times
  double fetch_trip_us;  // call, then fetch the result, N/10 times
  double grpc_us = 0;    // one bare unary RPC to the worker (Ping), N/10 times
  std::vector<std::string> hosts;
  // CPU microseconds per call + Fetch of this process (the client's), the controller's and the
  // worker's, when they are processes of their own: whether the round trip waits for work or
  // for cores (three processes on this machine's cores).
  double cpu_us[3] = {0, 0, 0};
  // With --threads: per process and thread name, the microseconds per call + Fetch its threads
  // ran and waited for a core (the last repeat's).
  std::vector<std::string> thread_rows;
};

// The processes behind a client whose CPU time is counted (pid 0: none).
struct CpuOf {
  pid_t controller = 0, worker = 0;
  bool threads = false;
};

Figures Measure(Client& client, int devices, int64_t calls, int repeats, CpuOf processes = {}) {
  VirtualSlice slice = *client.CreateSlice({.mesh_shape = {devices}});
  CompiledFunction inc = *client.Compile(FunctionSpec::Builtin(
      "add_one", {{DType::kF32, {devices}}}, {{DType::kF32, {devices}}}, {{"x"}}, {{"x"}}));
  std::vector<double> pipelined, round_trip, fetch_trip, cpu[3];
  std::vector<std::string> thread_rows;
  for (int r = 0; r < repeats; ++r) {
    ShardedArray x = *client.Put(*HostArray::Create(DType::kF32, {devices}), slice, {"x"});
    pipelined.push_back(MicrosPer(calls, [&] {
      for (int64_t i = 0; i < calls; ++i) x = (*client.Call(inc, slice, {x}))[0];
      HostArray out = *client.Fetch(x).Await();
      if (out.data<float>()[0] != static_cast<float>(calls)) std::fprintf(stderr, "wrong result\n");
    }));
    const int64_t sync_calls = std::max<int64_t>(1, calls / 10);
    round_trip.push_back(MicrosPer(sync_calls, [&] {
      for (int64_t i = 0; i < sync_calls; ++i) {
        x = (*client.Call(inc, slice, {x}))[0];
        (void)client.Ready(x).Await();
      }
    }));
    auto cpu_now = [&]() -> std::array<double, 3> {
      if (processes.controller == 0) return {0, 0, 0};
      return {bench::SelfCpuSeconds(), bench::ProcessCpuSeconds(processes.controller),
              bench::ProcessCpuSeconds(processes.worker)};
    };
    const pid_t pids[3] = {getpid(), processes.controller, processes.worker};
    std::map<std::string, bench::ThreadTime> threads0[3];
    if (processes.threads) {
      for (int k = 0; k < 3; ++k) threads0[k] = bench::ThreadTimes(pids[k]);
    }
    const std::array<double, 3> cpu0 = cpu_now();
    fetch_trip.push_back(MicrosPer(sync_calls, [&] {
      for (int64_t i = 0; i < sync_calls; ++i) {
        x = (*client.Call(inc, slice, {x}))[0];
        (void)client.Fetch(x).Await();
      }
    }));
    const std::array<double, 3> cpu1 = cpu_now();
    for (int k = 0; k < 3; ++k) cpu[k].push_back((cpu1[k] - cpu0[k]) * 1e6 / static_cast<double>(sync_calls));
    if (processes.threads) {
      thread_rows.clear();
      static const char* kProcess[] = {"client", "controller", "worker"};
      for (int k = 0; k < 3; ++k) {
        for (const auto& [name, t] : bench::ThreadTimes(pids[k])) {
          const bench::ThreadTime before = threads0[k].count(name) ? threads0[k][name] : bench::ThreadTime{};
          const double ran = static_cast<double>(t.ran_ns - before.ran_ns) / 1e3 / static_cast<double>(sync_calls);
          const double waited =
              static_cast<double>(t.waited_ns - before.waited_ns) / 1e3 / static_cast<double>(sync_calls);
          if (ran >= 0.5 || waited >= 0.5) {
            thread_rows.push_back(absl::StrFormat("| %s | %s | %.1f | %.1f |", kProcess[k], name, ran, waited));
          }
        }
      }
    }
  }
  return {Median(pipelined),
          Median(round_trip),
          Median(fetch_trip),
          0,
          slice.host_addresses(),
          {Median(cpu[0]), Median(cpu[1]), Median(cpu[2])},
          thread_rows};
}

// One bare unary gRPC call to the worker (Ping answers at once), over a channel of its own: the
// floor for any round trip through the network stack.
double MeasureGrpc(const std::string& address, int64_t calls, int repeats) {
  auto stub = rpc::Worker::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto ping = [&] {
    grpc::ClientContext context;
    rpc::PingRequest request;
    rpc::PingResponse response;
    if (!stub->Ping(&context, request, &response).ok()) std::fprintf(stderr, "ping failed\n");
  };
  for (int i = 0; i < 10; ++i) ping();  // connects
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) {
    runs.push_back(MicrosPer(calls, [&] {
      for (int64_t i = 0; i < calls; ++i) ping();
    }));
  }
  return Median(runs);
}

// The same kernel on a local device with no runtime around it: the floor.
double MeasureKernelOnly(int64_t calls, int repeats) {
  FunctionCache cache;
  CpuDevice device(0, 1 << 20);
  auto exe = *cache.Compile({FunctionBody::Kind::kBuiltin, "add_one", ""});
  BufferPtr a = *device.Allocate(DType::kF32, {1}), b = *device.Allocate(DType::kF32, {1});
  std::memset(a->data(), 0, 4);
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) {
    runs.push_back(MicrosPer(calls, [&] {
      for (int64_t i = 0; i < calls; ++i) {
        const DeviceBuffer* in[] = {a.get()};
        DeviceBuffer* out[] = {b.get()};
        (void)exe->Run(in, out);
        std::swap(a, b);
      }
    }));
  }
  return Median(runs);
}

int Main(int argc, char** argv) {
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"calls", "repeats", "devices", "threads"});
  const int64_t calls = bench::IntFlagOrExit(flags, "calls", 2000, 10);
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 5));
  const int devices = static_cast<int>(bench::IntFlagOrExit(flags, "devices", 1, 1, 64));
  const bool threads = flags.Get("threads", "false") == "true";

  // On a terminal, what is being measured: the kernel, the embedded cluster, then each repeat of
  // the two clusters of processes (on stderr: the table on stdout stays clean).
  bench::RowProgress progress("OpByOp", 2 + repeats);
  progress.Measuring("the kernel alone");
  const double kernel = MeasureKernelOnly(calls, repeats);

  progress.Measuring("an embedded cluster");
  auto cluster = *LocalCluster::Start({.num_islands = 1, .hosts_per_island = 1, .devices_per_host = devices});
  Figures embedded = Measure(**cluster->Connect(), devices, calls, repeats);
  cluster.reset();

  // Two clusters of real processes side by side: control traffic (the client's schedule
  // requests, the island control graph) over the plain TCP streams, and all of it over gRPC
  // (PATHWAYS_PLAIN_STREAMS=0, as before those streams), measured in turns.
  struct Processes {
    Subprocess controller, worker;
    std::unique_ptr<Client> client;
  };
  auto start = [&](Processes& p, bool plain) {
    // The switch goes to the processes through `env`, and to this process's client as an option
    // (setting the environment here would race with the other client's threads reading it).
    std::vector<std::string> prefix;
    if (!plain) prefix = {"/usr/bin/env", "PATHWAYS_PLAIN_STREAMS=0"};
    auto command = [&](std::vector<std::string> argv) {
      argv.insert(argv.begin(), prefix.begin(), prefix.end());
      return argv;
    };
    const std::string address =
        *StartController(p.controller, command({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"}));
    (void)StartWorker(p.worker, command({PATHWAYS_BINARY, "worker", "--controller", address, "--devices",
                                         std::to_string(devices), "--device-memory", "64MiB"}));
    p.client = *Client::Connect(address, {.schedule_stream = plain});
  };
  Processes streams, grpc_only;
  start(streams, true);
  start(grpc_only, false);
  std::vector<Figures> with_streams, with_grpc;
  std::vector<double> bare;
  for (int r = 0; r < repeats; ++r) {
    progress.Measuring(absl::StrCat("processes, repeat ", r + 1, " of ", repeats));
    with_streams.push_back(
        Measure(*streams.client, devices, calls, 1, {streams.controller.pid(), streams.worker.pid(), threads}));
    with_grpc.push_back(Measure(*grpc_only.client, devices, calls, 1));
    bare.push_back(MeasureGrpc(with_streams.back().hosts.front(), std::max<int64_t>(1, calls / 10), 1));
  }
  auto median = [](const std::vector<Figures>& runs, double Figures::*field) {
    std::vector<double> v;
    for (const Figures& f : runs) v.push_back(f.*field);
    return Median(v);
  };
  Figures multi{median(with_streams, &Figures::pipelined_us),
                median(with_streams, &Figures::round_trip_us),
                median(with_streams, &Figures::fetch_trip_us),
                Median(bare),
                {}};
  for (int k = 0; k < 3; ++k) {
    std::vector<double> v;
    for (const Figures& f : with_streams) v.push_back(f.cpu_us[k]);
    multi.cpu_us[k] = Median(v);
  }
  const Figures before{median(with_grpc, &Figures::pipelined_us), median(with_grpc, &Figures::round_trip_us),
                       median(with_grpc, &Figures::fetch_trip_us), 0, {}};
  for (Processes* p : {&streams, &grpc_only}) {
    p->client.reset();
    p->worker.Terminate(absl::Seconds(30));
    p->controller.Terminate(absl::Seconds(30));
  }
  progress.Printing();

  std::printf("OpByOp add_one on f32[%d] over %d device(s); median of %d runs of %lld calls\n\n",
              devices, devices, repeats, static_cast<long long>(calls));
  std::printf(
      "| mode | pipelined us/call | round trip us/call (Ready) | round trip us/call (Fetch) | pipelined / kernel "
      "only |\n");
  std::printf("|---|---|---|---|---|\n");
  std::printf("| kernel only (no runtime) | %.2f | - | - | 1.0 |\n", kernel);
  std::printf("| embedded (LocalCluster) | %.1f | %.1f | %.1f | %.0fx |\n", embedded.pipelined_us,
              embedded.round_trip_us, embedded.fetch_trip_us, embedded.pipelined_us / kernel);
  std::printf("| multi-process (loopback) | %.1f | %.1f | %.1f | %.0fx |\n", multi.pipelined_us,
              multi.round_trip_us, multi.fetch_trip_us, multi.pipelined_us / kernel);
  std::printf("| multi-process, control over gRPC (PATHWAYS_PLAIN_STREAMS=0) | %.1f | %.1f | %.1f | %.0fx |\n",
              before.pipelined_us, before.round_trip_us, before.fetch_trip_us, before.pipelined_us / kernel);
  std::printf("| bare gRPC unary (Ping to the worker) | - | %.1f | %.1f | - |\n", multi.grpc_us, multi.grpc_us);
  std::printf("\nmulti-process round trip / bare gRPC: %.2fx (Ready), %.2fx (Fetch); control over gRPC: %.2fx, %.2fx\n",
              multi.round_trip_us / multi.grpc_us, multi.fetch_trip_us / multi.grpc_us,
              before.round_trip_us / multi.grpc_us, before.fetch_trip_us / multi.grpc_us);
  const double cpu_all = multi.cpu_us[0] + multi.cpu_us[1] + multi.cpu_us[2];
  std::printf(
      "multi-process call + Fetch, CPU per call: client %.1f us, controller %.1f us, worker %.1f us; %.1f us in "
      "all against %.1f us of wall time (%.2f cores busy)\n",
      multi.cpu_us[0], multi.cpu_us[1], multi.cpu_us[2], cpu_all, multi.fetch_trip_us, cpu_all / multi.fetch_trip_us);
  if (threads && !with_streams.empty()) {
    std::printf(
        "\nPer thread, microseconds per call + Fetch (the last repeat; threads of one name together, those under "
        "0.5 us left out):\n\n| process | thread | ran | waited for a core |\n|---|---|---|---|\n");
    for (const std::string& row : with_streams.back().thread_rows) std::printf("%s\n", row.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
