// Dispatch throughput (the paper's Figure 5 set-up) on embedded clusters, and parallel against
// sequential dispatch in a pipeline (Figure 7) on an embedded cluster and on real processes (a
// worker per stage), with and without the emulated data-centre link between consecutive stages.
// Prints markdown tables; see docs/benchmarks.md.
//
//   build/bin/dispatch_bench [--repeats R] [--max-hosts H] [--max-stages K]
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <functional>

#include <signal.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench_util.h"
#include "chain.h"
#include "cluster/local_cluster.h"
#include "client/program.h"
#include "core/process.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::Median;
using bench::Seconds;

constexpr int kChain = 128;

void Check(const HostArray& a, float expected) {
  if (a.data<float>()[0] != expected) {
    std::fprintf(stderr, "wrong result %f, expected %f\n", a.data<float>()[0], expected);
    std::exit(1);
  }
}

// Computations per second of a tiny gang computation (add one to an f32[H] split over one
// device on each of H hosts), dispatched three ways.
void ThroughputTable(int max_hosts, int repeats) {
  std::printf("### Dispatch throughput: computations per second, end to end (median of %d)\n\n", repeats);
  std::printf("Client submit: client time to issue the %d computations, per computation.\n\n", kChain);
  std::printf("OpByOp waiting: each call waits until its run is enqueued on the hosts (`Client::Enqueued`) "
              "before the next, as the paper's client waits for the coordinator to enqueue a computation and "
              "return its output handles.\n\n");
  std::printf("| hosts | OpByOp | OpByOp waiting | Chained (%d-node program) | Fused (%d-iteration loop) "
              "| Chained / OpByOp | Chained / OpByOp waiting | client submit OpByOp us | client submit Chained us |\n",
              kChain, kChain);
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<int> sizes = bench::Doublings(max_hosts);
  bench::RowProgress progress("dispatch throughput", static_cast<int64_t>(sizes.size()));
  for (int hosts : sizes) {
    progress.Measuring(absl::StrCat(hosts, " hosts"));
    auto cluster = *LocalCluster::Start({.num_islands = 1, .hosts_per_island = hosts, .devices_per_host = 1,
                                         .device_memory_bytes = 16 << 20});
    auto client = *cluster->Connect();
    VirtualSlice slice = *client->CreateSlice({.mesh_shape = {hosts}});
    const TensorSpec spec{DType::kF32, {hosts}};
    CompiledFunction inc = *client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
    CompiledFunction fused = *client->Compile(FunctionSpec::Script(
        "fused", "def fused(x):\n    for _ in range(128):\n        x = x + 1.0\n    return x\n", {spec}, {spec},
        {{"x"}}, {{"x"}}));
    Program chain = *bench::ChainOf("chain128", inc, slice, spec, kChain);

    std::vector<double> opbyop, waiting, chained, fused_rate, submit_opbyop, submit_chained;
    for (int r = 0; r < repeats + 1; ++r) {  // the first round warms up and is dropped
      ShardedArray x = *client->Put(*HostArray::Create(DType::kF32, {hosts}), slice, {"x"});
      double s1 = 0, s2 = 0;
      double t1 = Seconds([&] {
        s1 = Seconds([&] {
          for (int i = 0; i < kChain; ++i) x = (*client->Call(inc, slice, {x}))[0];
        });
        Check(*client->Fetch(x).Await(), kChain);
      });
      double t2 = Seconds([&] {
        s2 = Seconds([&] { x = (*client->Run(chain, {x}))[0]; });
        Check(*client->Fetch(x).Await(), 2 * kChain);
      });
      double t3 = Seconds([&] {
        x = (*client->Call(fused, slice, {x}))[0];
        Check(*client->Fetch(x).Await(), 3 * kChain);
      });
      double t4 = Seconds([&] {
        for (int i = 0; i < kChain; ++i) {
          x = (*client->Call(inc, slice, {x}))[0];
          (void)client->Enqueued(x).Await();
        }
        Check(*client->Fetch(x).Await(), 4 * kChain);
      });
      if (r == 0) continue;
      opbyop.push_back(kChain / t1);
      waiting.push_back(kChain / t4);
      chained.push_back(kChain / t2);
      fused_rate.push_back(kChain / t3);
      submit_opbyop.push_back(s1 * 1e6 / kChain);
      submit_chained.push_back(s2 * 1e6 / kChain);
    }
    progress.Printing();
    std::printf("| %d | %.0f | %.0f | %.0f | %.0f | %.1fx | %.1fx | %.2f | %.2f |\n", hosts, Median(opbyop),
                Median(waiting), Median(chained), Median(fused_rate), Median(chained) / Median(opbyop),
                Median(chained) / Median(waiting), Median(submit_opbyop), Median(submit_chained));
    std::fflush(stdout);
  }
  std::printf("\n");
}

// A K-stage pipeline, stage k on its own host (`stages[k]`, one device each), each stage a
// ~0.1 ms matmul: time to run it once, parallel against sequential dispatch.
void PipelineTable(Client& client, const std::vector<VirtualSlice>& stages, const std::string& where, int repeats) {
  const int64_t n = 96;  // a 96x96 f32 matmul: about 0.1 ms on one core here
  const TensorSpec spec{DType::kF32, {n, n}};
  CompiledFunction stage_fn = *client.Compile(FunctionSpec::Script(
      "stage", "def stage(x):\n    return torch.tanh(x @ x) * 0.1\n", {spec}, {spec}));
  std::printf("### Pipeline of K stages, one host each, ~0.1 ms per stage, %s: ms per run (median of %d)\n\n",
              where.c_str(), repeats);
  std::printf("| stages | parallel dispatch | sequential dispatch | sequential / parallel |\n|---|---|---|---|\n");
  HostArray input = *HostArray::Create(DType::kF32, {n, n});
  for (int64_t i = 0; i < n * n; ++i) input.mutable_data<float>()[i] = static_cast<float>(i % 7) * 0.01f;
  const std::vector<int> lengths = bench::Doublings(std::min(16, static_cast<int>(stages.size())));
  bench::RowProgress progress("pipeline", static_cast<int64_t>(lengths.size()));
  for (int k : lengths) {
    progress.Measuring(absl::StrCat(k, " stages"));
    ProgramBuilder builder("pipeline");
    TracedValue v = builder.Arg(spec);
    for (int s = 0; s < k; ++s) v = (*builder.Call(stage_fn, stages[s], {v}))[0];
    Program program = *builder.Build({v});
    ShardedArray x = *client.Put(input, stages[0]);
    std::vector<double> parallel, sequential;
    for (int r = 0; r < repeats + 1; ++r) {
      for (auto mode : {RunOptions::Dispatch::kParallel, RunOptions::Dispatch::kSequential}) {
        double t = Seconds([&] {
          auto out = *client.Run(program, {x}, {.dispatch = mode});
          (void)*client.Ready(out[0]).Await();
        });
        if (r == 0) continue;
        (mode == RunOptions::Dispatch::kParallel ? parallel : sequential).push_back(t * 1e3);
      }
    }
    progress.Printing();
    std::printf("| %d | %.2f | %.2f | %.2fx |\n", k, Median(parallel), Median(sequential),
                Median(sequential) / Median(parallel));
    std::fflush(stdout);
  }
  std::printf("\n");
}

// One device per stage; the controller spreads slices over the least used devices, so stage k
// lands on its own host (on island k % islands when there are several).
std::vector<VirtualSlice> StageSlices(Client& client, int stages, int islands) {
  std::vector<VirtualSlice> out;
  for (int k = 0; k < stages; ++k) {
    SliceSpec spec{.mesh_shape = {1}};
    if (islands > 1) spec.island = k % islands;
    out.push_back(*client.CreateSlice(spec));
  }
  return out;
}

void EmbeddedPipelineTable(int max_stages, int repeats) {
  auto cluster = *LocalCluster::Start({.num_islands = 1, .hosts_per_island = max_stages, .devices_per_host = 1,
                                       .device_memory_bytes = 16 << 20});
  auto client = *cluster->Connect();
  PipelineTable(*client, StageSlices(*client, max_stages, 1), "embedded (hosts in one process)", repeats);
}

// The same over real processes: a controller and one worker process per stage, every block
// crossing a loopback socket; with `islands` = 2, consecutive stages on different islands joined
// by the emulated data-centre link (`dcn`: worker flags), so every block crosses it.
// False when its processes did not start (said on stderr).
bool ProcessPipelineTable(int max_stages, int islands, const std::vector<std::string>& dcn, int repeats) {
  Subprocess controller;
  std::vector<Subprocess> workers(static_cast<size_t>(max_stages));
  auto address = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"});
  if (!address.ok()) {
    std::fprintf(stderr, "controller: %s\n", std::string(address.status().message()).c_str());
    return false;
  }
  for (int k = 0; k < max_stages; ++k) {
    std::vector<std::string> argv = {PATHWAYS_BINARY, "worker",          "--controller", *address, "--devices", "1",
                                     "--device-memory", "16MiB", "--island", std::to_string(k % islands)};
    argv.insert(argv.end(), dcn.begin(), dcn.end());
    if (auto started = StartWorker(workers[k], argv); !started.ok()) {
      std::fprintf(stderr, "worker %d: %s\n", k, std::string(started.status().message()).c_str());
      return false;
    }
  }
  {
    auto client = *Client::Connect(*address);
    PipelineTable(*client, StageSlices(*client, max_stages, islands),
                  islands > 1 ? absl::StrCat("a worker process per stage, consecutive stages on 2 islands over the "
                                             "emulated link (", absl::StrJoin(dcn, " "), ")")
                              : std::string("a worker process per stage"),
                  repeats);
  }
  for (Subprocess& w : workers) w.Terminate(absl::Seconds(30));
  controller.Terminate(absl::Seconds(30));
  return true;
}

// CPU time of the calling thread: the client's own work, whatever the hosts in this process do.
double ThreadCpuMicros(const std::function<void()>& body) {
  timespec a, b;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  body();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  return (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3;
}

// Client work per run as shards grow: a two-node chain over slices of 1..512 devices on two hosts.
void ShardScalingTable(int repeats) {
  auto cluster = *LocalCluster::Start({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 256,
                                       .device_memory_bytes = 1 << 20});
  auto client = *cluster->Connect();
  std::printf("### Client work per run of a 2-node chain as shards grow (median of %d)\n\n", repeats);
  std::printf("Client CPU time of the Run call (thread CPU time, so the hosts sharing the process do not count).\n\n");
  std::printf("| shards | hosts | graph nodes | graph edges | first run (lowers, registers) us | later run us "
              "| run message bytes (one per island) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  const std::vector<int64_t> shard_counts = {1, 8, 64, 512};
  bench::RowProgress progress("client work per run", static_cast<int64_t>(shard_counts.size()));
  for (int64_t shards : shard_counts) {
    progress.Measuring(absl::StrCat(shards, " shards"));
    VirtualSlice slice = *client->CreateSlice({.mesh_shape = {shards}});
    const TensorSpec spec{DType::kF32, {1024}};
    auto inc = *client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
    auto neg = *client->Compile(FunctionSpec::Builtin("negate", {spec}, {spec}, {{"x"}}, {{"x"}}));
    ProgramBuilder builder("chain2");
    TracedValue v = builder.Arg(spec);
    v = (*builder.Call(inc, slice, {v}))[0];
    v = (*builder.Call(neg, slice, {v}))[0];
    Program program = *builder.Build({v});
    ShardedArray x = *client->Put(*HostArray::Create(DType::kF32, {1024}), slice, {"x"});
    std::vector<ShardedArray> out;
    const double first = ThreadCpuMicros([&] { out = *client->Run(program, {x}); });
    (void)*client->Ready(out[0]).Await();
    std::vector<double> submit, bytes;
    for (int r = 0; r < repeats; ++r) {
      ClientStats before = client->stats();
      out.clear();  // the previous result is freed outside the measured call
      submit.push_back(ThreadCpuMicros([&] { out = *client->Run(program, {x}); }));
      ClientStats after = client->stats();
      bytes.push_back(static_cast<double>(after.run_op_bytes_sent - before.run_op_bytes_sent) /
                      static_cast<double>(after.run_ops_sent - before.run_ops_sent));
      (void)*client->Ready(out[0]).Await();
    }
    progress.Printing();
    std::printf("| %lld | %zu | %lld | %lld | %.0f | %.1f | %.0f |\n", static_cast<long long>(shards),
                slice.host_addresses().size(), static_cast<long long>(program.num_graph_nodes()), static_cast<long long>(program.num_graph_edges()),
                first, Median(submit), Median(bytes));
    std::fflush(stdout);
  }
  std::printf("\n");
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) {
  using namespace pathways;
  InitServingProcess();
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  const Flags flags = bench::FlagsOrExit(argc, argv, {"repeats", "max-hosts", "max-stages"});
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 5));
  const int max_hosts = static_cast<int>(bench::IntFlagOrExit(flags, "max-hosts", 8, 1, 64));
  const int max_stages = static_cast<int>(bench::IntFlagOrExit(flags, "max-stages", 16, 1, 64));
  ThroughputTable(max_hosts, repeats);
  EmbeddedPipelineTable(max_stages, repeats);
  int failed = 0;
  if (!ProcessPipelineTable(max_stages, 1, {}, repeats)) ++failed;
  if (!ProcessPipelineTable(max_stages, 2, {"--dcn-latency-us", "50", "--dcn-gbps", "10"}, repeats)) ++failed;
  ShardScalingTable(repeats);
  return bench::ExitStatus(failed);
}
