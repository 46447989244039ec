// Per-call time of a trivial compiled function (add_one on f32[1]) called OpByOp: one client call
// per computation, on an embedded cluster and on real processes over loopback. Prints a markdown
// table; see docs/benchmarks.md for results.
//
//   build/bin/opbyop_bench [--calls N] [--repeats R] [--devices D]
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "bench_util.h"
#include "cluster/local_cluster.h"
#include "compute/executable.h"
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
};

Figures Measure(Client& client, int devices, int64_t calls, int repeats) {
  VirtualSlice slice = *client.CreateSlice({.mesh_shape = {devices}});
  CompiledFunction inc = *client.Compile(FunctionSpec::Builtin(
      "add_one", {{DType::kF32, {devices}}}, {{DType::kF32, {devices}}}, {{"x"}}, {{"x"}}));
  std::vector<double> pipelined, round_trip, fetch_trip;
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
    fetch_trip.push_back(MicrosPer(sync_calls, [&] {
      for (int64_t i = 0; i < sync_calls; ++i) {
        x = (*client.Call(inc, slice, {x}))[0];
        (void)client.Fetch(x).Await();
      }
    }));
  }
  return {Median(pipelined), Median(round_trip), Median(fetch_trip), 0, slice.host_addresses()};
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
  const Flags flags = bench::FlagsOrExit(argc, argv, {"calls", "repeats", "devices"});
  const int64_t calls = bench::IntFlagOrExit(flags, "calls", 2000, 10);
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 5));
  const int devices = static_cast<int>(bench::IntFlagOrExit(flags, "devices", 1, 1, 64));

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
    with_streams.push_back(Measure(*streams.client, devices, calls, 1));
    with_grpc.push_back(Measure(*grpc_only.client, devices, calls, 1));
    bare.push_back(MeasureGrpc(with_streams.back().hosts.front(), std::max<int64_t>(1, calls / 10), 1));
  }
  auto median = [](const std::vector<Figures>& runs, double Figures::*field) {
    std::vector<double> v;
    for (const Figures& f : runs) v.push_back(f.*field);
    return Median(v);
  };
  const Figures multi{median(with_streams, &Figures::pipelined_us), median(with_streams, &Figures::round_trip_us),
                      median(with_streams, &Figures::fetch_trip_us), Median(bare), {}};
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
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
