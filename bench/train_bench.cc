// Training throughput of the Transformer (train/trainer.h) on embedded clusters: the same model and
// global batch SPMD over all devices against pipelines of 2, 4 and 8 stages, and data parallel over
// two islands joined by an emulated data-centre link against one island of as many devices; with
// the model FLOP/s utilisation against the machine's matmul FLOP/s measured in the same run.
// And the paper's Table 1 comparison: the same SPMD step on real processes, one controller
// (worker processes of a `pathways` cluster) against the multi-controller baseline on the same
// functions and collectives (peers/multicontroller_train.cc), for each HOSTSxDEVICES of
// --multi-controller (default 2x(devices/2),(devices)x1), --mc-tensor-way tensor parallel (default
// 1) and data parallel over the rest. Prints markdown tables; see docs/training.md.
//
//   build/bin/train_bench [--devices 8] [--layers 8] [--batch 32] [--steps 10] [--repeats 3]
//                         [--dcn-latency-us 50] [--dcn-gbps 10] [--trace-prefix P]
//                         [--multi-controller 2x4,8x1] [--mc-tensor 1] [--tables all|multi-controller]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "bench_util.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "core/process.h"
#include "process_cluster.h"
#include "testing/subprocess.h"
#include "tools/flags.h"
#include "train/trainer.h"

namespace pathways {
namespace {

using bench::Median;
using bench::Seconds;

template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(v.status().message()).c_str());
    std::exit(1);
  }
  return *std::move(v);
}

// The machine's matmul rate: every device of a slice spanning all of a one-island cluster's
// devices multiplies two n x n matrices, `calls` times.
double MatmulFlops(LocalCluster& cluster, int64_t devices, int repeats) {
  constexpr int64_t n = 512;
  constexpr int kCalls = 20;
  auto client = OrDie(cluster.Connect(), "connect");
  VirtualSlice slice = OrDie(client->CreateSlice({.mesh_shape = {devices}}), "slice");
  const TensorSpec spec{DType::kF32, {n, n}};
  CompiledFunction mm = OrDie(client->Compile(FunctionSpec::Builtin("matmul", {spec, spec}, {spec})), "compile");
  ShardedArray a = OrDie(client->Put(OrDie(HostArray::Create(DType::kF32, {n, n}), "array"), slice), "put");
  std::vector<double> rates;
  for (int r = 0; r <= repeats; ++r) {
    const double s = Seconds([&] {
      std::vector<ShardedArray> outs;
      for (int i = 0; i < kCalls; ++i) outs.push_back(OrDie(client->Call(mm, slice, {a, a}), "call")[0]);
      for (const ShardedArray& o : outs) (void)client->Ready(o).Await();
    });
    if (r > 0) rates.push_back(2.0 * n * n * n * kCalls * static_cast<double>(devices) / s);
  }
  return Median(rates);
}

// Model FLOPs per token (forward and backward, not counting the recomputed forward): 6 per
// parameter outside the embeddings, plus attention's scores and weighted sums.
double FlopsPerToken(const TransformerConfig& c) {
  const double d = static_cast<double>(c.d_model), l = static_cast<double>(c.layers);
  const double dense = l * (4 * d * d + 2 * d * static_cast<double>(c.mlp_hidden)) + d * static_cast<double>(c.vocab);
  return 6 * dense + 12 * l * d * static_cast<double>(c.seq_len);
}

struct Result {
  double tokens_per_s;
  double loss;
  size_t calls;
  double peak_mib;  // the most device memory any one device held at once, after warming up
};

template <typename F>
void ForEachDevice(LocalCluster& cluster, F f) {
  for (int w = 0; w < cluster.num_workers(); ++w) {
    HostRuntime& runtime = cluster.worker(w).runtime();
    for (int d = 0; d < runtime.num_devices(); ++d) f(runtime.device(d));
  }
}

Result Measure(LocalCluster& cluster, const TrainOptions& options, int steps, int repeats,
               const std::string& trace) {
  auto client = OrDie(cluster.Connect(), "connect");
  auto trainer = OrDie(Trainer::Create(*client, options), "trainer");
  for (int i = 0; i < 2; ++i) (void)OrDie(trainer->Step(), "step").Await();  // warm up: compile, first runs
  ForEachDevice(cluster, [](Device& d) { d.ResetMemoryPeak(); });
  std::vector<double> rates;
  double loss = 0;
  for (int r = 0; r < repeats; ++r) {
    const absl::Time start = absl::Now();
    const double s = Seconds([&] {
      Future<double> last;
      for (int i = 0; i < steps; ++i) last = OrDie(trainer->Step(), "step");
      loss = OrDie(last.Await(), "loss");
    });
    rates.push_back(static_cast<double>(steps * trainer->tokens_per_step()) / s);
    if (!trace.empty() && r == repeats - 1) (void)client->WriteTrace(trace, start);
  }
  int64_t peak = 0;
  ForEachDevice(cluster, [&](Device& d) { peak = std::max(peak, d.stats().memory_peak); });
  return {Median(rates), loss, trainer->step_program().calls().size(), static_cast<double>(peak) / (1 << 20)};
}

struct Table1Row {
  double tokens_per_s = 0;
  double loss = 0;
};

// SPMD training over `hosts` worker processes of `devices` devices, `tensor`-way tensor parallel
// and data parallel over the rest; one controller, one client.
Table1Row MeasureOneController(int hosts, int devices, int64_t tensor, const TrainOptions& base, int steps,
                               int repeats) {
  bench::ProcessCluster cluster;
  if (absl::Status s = cluster.Start(PATHWAYS_BINARY, hosts, devices, int64_t{1} << 30); !s.ok()) {
    std::fprintf(stderr, "cluster: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  auto client = OrDie(Client::Connect(cluster.address()), "connect");
  TrainOptions o = base;
  o.layout = {.data = static_cast<int64_t>(hosts) * devices / tensor, .tensor = tensor, .stages = 1};
  auto trainer = OrDie(Trainer::Create(*client, o), "trainer");
  for (int i = 0; i < 2; ++i) (void)OrDie(trainer->Step(), "step").Await();  // as the peer warms up
  std::vector<double> rates;
  Table1Row row;
  for (int r = 0; r < repeats; ++r) {
    const double s = Seconds([&] {
      Future<double> last;
      for (int i = 0; i < steps; ++i) last = OrDie(trainer->Step(), "step");
      row.loss = OrDie(last.Await(), "loss");
    });
    rates.push_back(static_cast<double>(steps * trainer->tokens_per_step()) / s);
  }
  row.tokens_per_s = Median(rates);
  return row;
}

// The same step run by `hosts` processes of `devices` devices each, with no controller.
Table1Row MeasureMultiController(int hosts, int devices, int64_t tensor, const TrainOptions& base, int steps,
                                 int repeats) {
  auto lines = bench::RunPeerRanks(
      hosts,
      [&](int r, const std::string& dir) -> std::vector<std::string> {
        return {MC_TRAIN_PEER, std::to_string(r), std::to_string(hosts), std::to_string(devices), dir,
                std::to_string(base.model.layers), std::to_string(base.batch), std::to_string(steps),
                std::to_string(repeats), std::to_string(tensor)};
      },
      2 * repeats, absl::Minutes(10));
  if (!lines.ok()) {
    std::fprintf(stderr, "the multi-controller peer: %s\n", std::string(lines.status().message()).c_str());
    std::exit(1);
  }
  std::vector<double> rates;
  std::optional<double> loss;
  for (absl::string_view l : *lines) {
    double v = 0;
    if (absl::ConsumePrefix(&l, "tokens_per_s ") && absl::SimpleAtod(l, &v)) rates.push_back(v);
    if (absl::ConsumePrefix(&l, "loss ") && absl::SimpleAtod(l, &v)) loss = v;
  }
  if (static_cast<int>(rates.size()) != repeats || !loss.has_value()) {
    std::fprintf(stderr, "the multi-controller peer printed %zu of %d rates%s\n", rates.size(), repeats,
                 loss.has_value() ? "" : " and no loss");
    std::exit(1);
  }
  return {Median(rates), *loss};
}

// The paper's Table 1: one controller against multi-controller on the same SPMD step.
int MultiControllerTable(const std::vector<std::pair<int, int>>& configs, int64_t tensor, const TrainOptions& base,
                         int steps, int repeats) {
  std::printf("\n### SPMD training on real processes: one controller against multi-controller (the paper's "
              "Table 1)\n\n");
  std::printf("Worker processes of a `pathways` cluster, against as many processes running the same functions "
              "and collectives with no controller (`multicontroller_train`). Both draw the same data and start "
              "from the same parameters, so after the same steps their losses agree.\n\n");
  std::printf("| processes x devices | data x tensor | one controller tokens/s | multi-controller tokens/s | ratio "
              "| loss, one controller | loss, multi-controller |\n|---|---|---|---|---|---|---|\n");
  bench::RowProgress mc_progress("one controller against multi-controller", static_cast<int64_t>(configs.size()));
  bool agree = true;
  for (auto [hosts, per_host] : configs) {
    const int64_t data = static_cast<int64_t>(hosts) * per_host / tensor;
    if ((static_cast<int64_t>(hosts) * per_host) % tensor != 0 || base.batch % data != 0) {
      std::fprintf(stderr,
                   "--multi-controller %dx%d, --mc-tensor %lld: the devices or the batch of %lld do not split\n", hosts,
                   per_host, static_cast<long long>(tensor), static_cast<long long>(base.batch));
      return 2;
    }
    mc_progress.Measuring(absl::StrCat(hosts, "x", per_host));
    const Table1Row ours = MeasureOneController(hosts, per_host, tensor, base, steps, repeats);
    const Table1Row theirs = MeasureMultiController(hosts, per_host, tensor, base, steps, repeats);
    mc_progress.Printing();
    std::printf("| %d x %d | %lld x %lld | %.0f | %.0f | %.2f | %.6f | %.6f |\n", hosts, per_host,
                static_cast<long long>(data), static_cast<long long>(tensor), ours.tokens_per_s,
                theirs.tokens_per_s, ours.tokens_per_s / theirs.tokens_per_s, ours.loss, theirs.loss);
    std::fflush(stdout);
    // The two ran the same steps from the same start: a loss apart means one of them trained
    // something else (the smoke test fails on it).
    if (!(std::abs(ours.loss - theirs.loss) <= 1e-5 * std::max(1.0, std::abs(ours.loss)))) {
      std::fprintf(stderr, "%dx%d: one controller's loss %.6f and multi-controller's %.6f differ\n", hosts, per_host,
                   ours.loss, theirs.loss);
      agree = false;
    }
  }
  return agree ? 0 : 1;
}

int Main(int argc, char** argv) {
  InitServingProcess();
  Subprocess::KillEveryChildWhenParentEnds();  // no cluster or peer outlives a benchmark that exits or is killed
  const Flags flags = bench::FlagsOrExit(
      argc, argv, {"devices", "layers", "batch", "steps", "repeats", "dcn-latency-us", "dcn-gbps", "trace-prefix",
                   "multi-controller", "mc-tensor", "tables"});
  const int64_t devices = OrDie(flags.GetInt("devices", 8), "--devices");
  const int64_t layers = OrDie(flags.GetInt("layers", 8), "--layers");
  const int64_t batch = OrDie(flags.GetInt("batch", 32), "--batch");
  const int steps = static_cast<int>(OrDie(flags.GetInt("steps", 10), "--steps"));
  const int repeats = static_cast<int>(OrDie(flags.GetInt("repeats", 3), "--repeats"));
  const int64_t latency_us = OrDie(flags.GetInt("dcn-latency-us", 50), "--dcn-latency-us");
  const int64_t gbps = OrDie(flags.GetInt("dcn-gbps", 10), "--dcn-gbps");
  const std::string trace_prefix = flags.Get("trace-prefix");
  const std::vector<std::pair<int, int>> mc_configs = bench::ConfigsOrExit(
      flags.Get("multi-controller", absl::StrCat("2x", std::max<int64_t>(1, devices / 2), ",", devices, "x1")));
  if (devices < 2 || (devices & (devices - 1)) != 0 || layers < 1 || batch < 1 || steps < 1 || repeats < 1) {
    std::fprintf(stderr, "need --devices a power of two >= 2 and positive --layers, --batch, --steps, --repeats\n");
    return 2;
  }

  const int64_t mc_tensor = OrDie(flags.GetInt("mc-tensor", 1), "--mc-tensor");
  if (mc_tensor < 1 || mc_tensor > 64) {
    std::fprintf(stderr, "--mc-tensor is 1 to 64, not %lld\n", static_cast<long long>(mc_tensor));
    return 2;
  }
  const std::string tables = flags.Get("tables", "all");
  if (tables != "all" && tables != "multi-controller") {
    std::fprintf(stderr, "--tables is all or multi-controller, not '%s'\n", tables.c_str());
    return 2;
  }
  TrainOptions base;
  base.model = OrDie(TransformerPreset("small"), "model");
  base.model.layers = layers;
  base.batch = batch;
  std::printf("Model: %s; global batch %lld x %lld tokens; %d steps per measurement, median of %d.\n\n",
              base.model.ToString().c_str(), static_cast<long long>(batch),
              static_cast<long long>(base.model.seq_len), steps, repeats);
  if (tables == "multi-controller") return MultiControllerTable(mc_configs, mc_tensor, base, steps, repeats);

  // One island of `devices` devices, two per host.
  auto one_island = OrDie(LocalCluster::Start({.num_islands = 1, .hosts_per_island = static_cast<int>(devices / 2),
                                               .devices_per_host = 2, .device_memory_bytes = int64_t{1} << 30}),
                          "cluster");
  const double matmul = MatmulFlops(*one_island, devices, repeats);
  const double per_token = FlopsPerToken(base.model);
  std::printf("Matmul (512 x 512, every device at once): %.2f GFLOP/s. Model FLOPs per token: %.2f M.\n\n",
              matmul / 1e9, per_token / 1e6);

  std::printf("### SPMD against pipelines (%lld devices, one island)\n\n", static_cast<long long>(devices));
  std::printf("Pipelines keep each stage's residuals (the default) or recompute its forward pass (--recompute).\n\n");
  std::printf("| layout | calls per step | tokens/s | of SPMD | model FLOP/s utilisation | peak MiB per device | loss after |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  double spmd = 0;
  // M = 2S microbatches keeping residuals, then recomputing them; then M = S, the per-device
  // microbatch as large as SPMD's batch, for a larger bubble. One way to run SPMD.
  struct Layout {
    int64_t stages;
    int64_t microbatches_per_stage;
    bool recompute;
  };
  std::vector<Layout> layouts;
  for (int64_t stages = 1; stages <= std::min<int64_t>(8, std::min(devices, layers)); stages *= 2) {
    for (const Layout v : {Layout{stages, 2, false}, Layout{stages, 2, true}, Layout{stages, 1, false}}) {
      if (stages == 1 && (v.recompute || v.microbatches_per_stage == 1)) continue;
      layouts.push_back(v);
    }
  }
  bench::RowProgress progress("SPMD against pipelines", static_cast<int64_t>(layouts.size()));
  for (const Layout& v : layouts) {
    const int64_t stages = v.stages;
    const bool recompute = v.recompute;
    TrainOptions o = base;
    o.layout = {.data = devices / stages, .tensor = 1, .stages = stages};
    o.microbatches = stages == 1 ? 1 : v.microbatches_per_stage * stages;
    o.recompute = recompute;
    while (o.microbatches > 1 && batch % (o.layout.data * o.microbatches) != 0) o.microbatches /= 2;
    const std::string trace = trace_prefix.empty() || stages == 1
                                  ? ""
                                  : absl::StrCat(trace_prefix, "pipeline_s", stages, "_m", o.microbatches,
                                                 recompute ? "_recompute" : "", ".json");
    const std::string layout = stages == 1 ? absl::StrCat("SPMD: data ", devices)
                                           : absl::StrCat("S=", stages, " x data ", o.layout.data, ", M=",
                                                          o.microbatches, recompute ? ", recomputing" : ", residuals kept");
    progress.Measuring(layout);
    const Result r = Measure(*one_island, o, steps, repeats, trace);
    progress.Printing();
    if (stages == 1) spmd = r.tokens_per_s;
    std::printf("| %s | %zu | %.0f | %.2f | %.1f%% | %.1f | %.4f |\n", layout.c_str(),
                r.calls, r.tokens_per_s, r.tokens_per_s / spmd, 100 * r.tokens_per_s * per_token / matmul,
                r.peak_mib, r.loss);
    std::fflush(stdout);
  }
  one_island.reset();

  // Across islands joined by an emulated link, against one island of as many devices: data
  // parallelism over two islands (the paper's Figure 12), and a pipeline with a stage per island
  // over four (its Figure 10).
  struct AcrossIslands {
    const char* title;
    int islands;
    ParallelLayout layout;
    int64_t microbatches;
    const char* trace;
  };
  std::vector<AcrossIslands> experiments = {
      {"Data parallelism over two islands (the paper's Figure 12)", 2, {.data = devices, .tensor = 1, .stages = 1}, 1,
       "two_islands.json"}};
  if (devices >= 4 && layers >= 4) {
    experiments.push_back({"A pipeline of four stages over four islands (the paper's Figure 10)", 4,
                           {.data = devices / 4, .tensor = 1, .stages = 4}, 4, "four_islands.json"});
  }
  for (const AcrossIslands& e : experiments) {
    std::printf("\n### %s: an emulated link (%lld us one way, %lld Gbit/s) against one island\n\n", e.title,
                static_cast<long long>(latency_us), static_cast<long long>(gbps));
    std::printf("| cluster | tokens/s | of one island | loss after |\n|---|---|---|---|\n");
    double single = 0;
    bench::RowProgress islands_progress(e.title, 2);
    for (int islands : {1, e.islands}) {
      islands_progress.Measuring(absl::StrCat(islands, islands == 1 ? " island" : " islands"));
      const int per_host = devices / islands >= 2 ? 2 : 1;
      LocalClusterOptions c{.num_islands = islands,
                            .hosts_per_island = static_cast<int>(devices / islands / per_host),
                            .devices_per_host = per_host,
                            .device_memory_bytes = int64_t{1} << 30};
      if (islands > 1) c.dcn = {.latency = absl::Microseconds(latency_us), .gbps = static_cast<double>(gbps)};
      auto cluster = OrDie(LocalCluster::Start(c), "cluster");
      TrainOptions o = base;
      o.layout = e.layout;
      o.microbatches = e.microbatches;
      while (o.microbatches > 1 && batch % (o.layout.data * o.microbatches) != 0) o.microbatches /= 2;
      o.islands = islands;
      const std::string trace = trace_prefix.empty() || islands == 1 ? "" : absl::StrCat(trace_prefix, e.trace);
      const Result r = Measure(*cluster, o, steps, repeats, trace);
      if (islands == 1) single = r.tokens_per_s;
      islands_progress.Printing();
      std::printf("| %d island%s x %lld devices | %.0f | %.3f | %.4f |\n", islands, islands == 1 ? "" : "s",
                  static_cast<long long>(devices / islands), r.tokens_per_s, r.tokens_per_s / single, r.loss);
      std::fflush(stdout);
    }
  }
  return MultiControllerTable(mc_configs, mc_tensor, base, steps, repeats);
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
