// Task Bench's METG for its stencil pattern (Slaughter et al., "Task Bench: A Parameterized
// Benchmark for Evaluating Parallel Runtime Performance", SC20), on this runtime and on OpenMPI
// in the same run, real processes on loopback.
//
//   build/bin/task_bench [--configs 1x1,4x1,16x1] [--steps 16] [--elements 1024] [--repeats 3]
//                        [--iterations 1,4,16,64,256,1024,4096,16384]
//
// The stencil: a row of W tasks (one per device of a slice of W devices, or one per MPI rank),
// repeated for `steps` timesteps; the task at (t, i) reads the results of (t-1, i-1), (t-1, i)
// and (t-1, i+1) (a ring), then runs a compute-bound kernel: `iterations` times y = y * a + b over
// `elements` floats, the same C++ loop on both systems (`pathways.fma_loop` in a body, the same
// loop in the MPI peer), as Task Bench links one kernel library into every system. On this
// runtime a timestep is one compiled function over the slice: each shard gets one value from
// each neighbour by `pathways.roll` (point to point, as MPI's neighbours exchange); OpByOp makes
// one client call per timestep, Chained one program of `steps` nodes. The MPI peer
// (peers/mpi_stencil.c) exchanges with its two neighbours by MPI_Sendrecv.
//
// As in Task Bench, for each kernel size: the task granularity is wall time x cores used / tasks
// (cores used: the machine's, or fewer when fewer tasks run at once); the efficiency is the FLOP
// rate over the peak, the best rate any system reached in the sweep on that configuration; and
// METG(50%) is the smallest granularity at which the efficiency is still 50% or more.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench_util.h"
#include "chain.h"
#include "client/client.h"
#include "client/program.h"
#include "core/process.h"
#include "core/status_macros.h"
#include "process_cluster.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::Median;
using bench::ProcessCluster;
using bench::Seconds;

constexpr float kScale = 0.999f, kShift = 0.001f;

std::string StencilSource(int64_t iterations) {
  return absl::StrCat("def stencil(x):\n",
                      "    left = pathways.roll(x[0:1], 'x', 1)\n",
                      "    right = pathways.roll(x[0:1], 'x', -1)\n",
                      "    return pathways.fma_loop((x + left + right) * (1.0 / 3.0), ", iterations, ", ", kScale,
                      ", ", kShift, ")\n");
}

// What every element of task i holds after `steps` timesteps from x = i, computed here.
std::vector<double> Expected(int width, int64_t iterations, int steps) {
  std::vector<double> x(width);
  for (int i = 0; i < width; ++i) x[i] = i;
  for (int t = 0; t < steps; ++t) {
    std::vector<double> y(width);
    for (int i = 0; i < width; ++i) {
      double v = (x[i] + x[(i + width - 1) % width] + x[(i + 1) % width]) * (1.0 / 3.0);
      for (int64_t k = 0; k < iterations; ++k) v = v * kScale + kShift;
      y[i] = v;
    }
    x = y;
  }
  return x;
}

struct Point {
  int64_t iterations = 0;
  double seconds = 0;  // wall time of the `steps` timesteps, median of the repeats
};

struct RuntimePoints {
  std::vector<Point> opbyop, chained;
};

absl::StatusOr<RuntimePoints> MeasureRuntime(int hosts, int devices, int steps, int64_t elements,
                                             const std::vector<int64_t>& sweep, int repeats) {
  const int width = hosts * devices;
  ProcessCluster cluster;
  PW_RETURN_IF_ERROR(cluster.Start(PATHWAYS_BINARY, hosts, devices, 64 << 20));
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(cluster.address()));
  PW_ASSIGN_OR_RETURN(VirtualSlice slice, client->CreateSlice({.mesh_shape = {width}}));
  const TensorSpec spec{DType::kF32, {width * elements}};
  PW_ASSIGN_OR_RETURN(HostArray initial, HostArray::Create(DType::kF32, {width * elements}));
  for (int64_t i = 0; i < width * elements; ++i) initial.mutable_data<float>()[i] = static_cast<float>(i / elements);
  RuntimePoints points;
  for (int64_t iterations : sweep) {
    PW_ASSIGN_OR_RETURN(CompiledFunction step,
                        client->Compile(FunctionSpec::Script("stencil", StencilSource(iterations), {spec},
                                                             {spec}, {{"x"}}, {{"x"}})));
    PW_ASSIGN_OR_RETURN(Program chain, bench::ChainOf("stencil_chain", step, slice, spec, steps));
    const std::vector<double> want = Expected(width, iterations, steps);
    // Runs `steps` timesteps from the initial values, checks the result and returns the seconds
    // until it was ready on the devices.
    auto run = [&](bool chained) -> absl::StatusOr<double> {
      PW_ASSIGN_OR_RETURN(ShardedArray x, client->Put(initial, slice, {"x"}));
      PW_RETURN_IF_ERROR(client->Ready(x).Await().status());
      absl::Status failure;
      const double t = Seconds([&] {
        if (chained) {
          auto out = client->Run(chain, {x});
          if (!out.ok()) failure = out.status();
          if (out.ok()) x = (*out)[0];
        } else {
          for (int i = 0; i < steps && failure.ok(); ++i) {
            auto out = client->Call(step, slice, {x});
            if (!out.ok()) failure = out.status();
            if (out.ok()) x = (*out)[0];
          }
        }
        if (failure.ok()) failure = client->Ready(x).Await().status();
      });
      PW_RETURN_IF_ERROR(failure);
      PW_ASSIGN_OR_RETURN(HostArray got, client->Fetch(x).Await());
      for (int i = 0; i < width; ++i) {
        const double value = got.data<float>()[i * elements + elements - 1];
        if (std::abs(value - want[i]) > 1e-3 * std::max(1.0, std::abs(want[i]))) {
          return absl::InternalError(absl::StrCat("task ", i, " ends at ", value, ", expected ", want[i]));
        }
      }
      return t;
    };
    for (bool chained : {false, true}) {
      std::vector<double> times;
      for (int r = 0; r < repeats + 1; ++r) {  // the first warms up (and registers the program)
        PW_ASSIGN_OR_RETURN(double t, run(chained));
        if (r > 0) times.push_back(t);
      }
      (chained ? points.chained : points.opbyop).push_back({iterations, Median(times)});
    }
  }
  return points;
}

// The MPI peer's points; empty when it cannot run.
std::vector<Point> MeasureMpi(int ranks, int steps, int64_t elements, const std::vector<int64_t>& sweep, int repeats) {
  std::vector<Point> points;
  for (int64_t iterations : sweep) {
    auto out = RunCommand({"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "tcp,self",
                           "--mca", "btl_tcp_if_include", "lo", "-np", std::to_string(ranks), MPI_STENCIL_PEER,
                           std::to_string(elements), std::to_string(iterations), std::to_string(steps),
                           std::to_string(repeats)},
                          absl::Seconds(600));
    if (!out.ok()) {
      std::fprintf(stderr, "OpenMPI stencil at %d ranks: %s\n", ranks, std::string(out.status().message()).c_str());
      return {};
    }
    std::vector<double> times;
    for (absl::string_view line : absl::StrSplit(*out, '\n')) {
      double t;
      if (absl::ConsumePrefix(&line, "seconds ") && absl::SimpleAtod(line, &t)) times.push_back(t);
    }
    if (static_cast<int>(times.size()) != repeats) {  // the peer failed part way
      std::fprintf(stderr, "OpenMPI stencil at %d ranks, %lld iterations: %zu of %d repeats\n", ranks,
                   static_cast<long long>(iterations), times.size(), repeats);
      return {};
    }
    points.push_back({iterations, Median(times)});
  }
  return points;
}

struct Summary {
  std::optional<double> metg_us;
};

// Prints one system's rows and returns its METG(50%). `peak` is the best FLOP rate of any system.
Summary PrintRows(const std::string& config, const std::string& system, const std::vector<Point>& points, int width,
                  int steps, int64_t elements, double peak, int cores) {
  Summary summary;
  for (const Point& p : points) {
    const double tasks = static_cast<double>(width) * steps;
    const double flops = tasks * 2.0 * static_cast<double>(elements) * static_cast<double>(p.iterations);
    const double rate = flops / p.seconds;
    const double granularity_us = p.seconds * cores / tasks * 1e6;
    const double efficiency = rate / peak;
    if (efficiency >= 0.5 && (!summary.metg_us || granularity_us < *summary.metg_us)) {
      summary.metg_us = granularity_us;
    }
    std::printf("| %s | %s | %lld | %.3f | %.1f | %.2f | %.0f%% |\n", config.c_str(), system.c_str(),
                static_cast<long long>(p.iterations), p.seconds * 1e3, granularity_us, rate / 1e9, 100 * efficiency);
  }
  return summary;
}

double Peak(const std::vector<std::vector<Point>>& systems, int width, int steps, int64_t elements) {
  double peak = 0;
  for (const auto& points : systems) {
    for (const Point& p : points) {
      const double flops = static_cast<double>(width) * steps * 2.0 * elements * static_cast<double>(p.iterations);
      peak = std::max(peak, flops / p.seconds);
    }
  }
  return peak;
}

std::vector<int64_t> ParseSweep(const std::string& text, const char* flag) {
  std::vector<int64_t> sweep;
  for (absl::string_view s : absl::StrSplit(text, ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1 || n > (int64_t{1} << 24)) {
      std::fprintf(stderr, "bad --%s '%s': want iteration counts from 1 to 2^24\n", flag, std::string(s).c_str());
      std::exit(2);
    }
    sweep.push_back(n);
  }
  return sweep;
}

std::string Format(const std::optional<double>& us) {
  return us ? absl::StrFormat("%.1f µs", *us) : std::string("not reached");
}

int Main(int argc, char** argv) {
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"configs", "steps", "elements", "repeats", "iterations"});
  const int steps = static_cast<int>(bench::IntFlagOrExit(flags, "steps", 16, 1, 1024));
  const int64_t elements = bench::IntFlagOrExit(flags, "elements", 1024, 1, 1 << 20);
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 3, 1, 50));
  const std::vector<int64_t> sweep =
      ParseSweep(flags.Get("iterations", "1,4,16,64,256,1024,4096,16384"), "iterations");
  const std::vector<std::pair<int, int>> configs = bench::ConfigsOrExit(flags.Get("configs", "1x1,4x1,16x1"));
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const bool have_mpi = access(MPI_STENCIL_PEER, X_OK) == 0 && access("/usr/bin/mpirun", X_OK) == 0;
  if (!have_mpi) std::printf("OpenMPI: not installed or peer not built (make deps-bench, then rebuild)\n\n");
  std::printf(
      "Task Bench stencil: W tasks per timestep (one per device or rank), %d timesteps, each task y = y * a + b over "
      "%lld floats, `iterations` times, after reading its two neighbours' results. Wall time of the %d timesteps "
      "(median of %d); granularity = wall x cores used (%d, or fewer tasks per timestep) / tasks; efficiency = FLOP "
      "rate / the best rate of any system on the configuration.\n\n",
      steps, static_cast<long long>(elements), steps, repeats, cores);
  std::printf("| hosts x devices | system | iterations | wall ms | granularity µs | GFLOP/s | efficiency |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::vector<std::string> summary;
  int failed = 0;
  bench::RowProgress progress("Task Bench", static_cast<int64_t>(configs.size()) * (have_mpi ? 2 : 1));
  for (auto [hosts, devices] : configs) {
    const int width = hosts * devices;
    const std::string config = absl::StrCat(hosts, "x", devices);
    progress.Measuring(config + ", this runtime");
    auto ours = MeasureRuntime(hosts, devices, steps, elements, sweep, repeats);
    progress.Printing();
    if (!ours.ok()) {
      std::printf("| %s | this runtime | failed: %s |\n", config.c_str(), std::string(ours.status().message()).c_str());
      ++failed;
      continue;
    }
    if (have_mpi) progress.Measuring(config + ", OpenMPI");
    const std::vector<Point> mpi = have_mpi ? MeasureMpi(width, steps, elements, sweep, repeats)
                                            : std::vector<Point>{};
    progress.Printing();
    const double peak = Peak({ours->opbyop, ours->chained, mpi}, width, steps, elements);
    const int used = std::min(cores, width);
    const Summary opbyop = PrintRows(config, "OpByOp", ours->opbyop, width, steps, elements, peak, used);
    const Summary chained = PrintRows(config, "Chained", ours->chained, width, steps, elements, peak, used);
    const Summary mpi_summary = PrintRows(config, "OpenMPI", mpi, width, steps, elements, peak, used);
    std::fflush(stdout);
    summary.push_back(absl::StrFormat("| %s | %s | %s | %s |", config, Format(opbyop.metg_us), Format(chained.metg_us),
                                      mpi.empty() ? std::string("n/a") : Format(mpi_summary.metg_us)));
  }
  std::printf("\nMETG(50%%): the smallest task granularity measured at 50%% efficiency or more\n\n");
  std::printf("| hosts x devices | OpByOp | Chained | OpenMPI |\n|---|---|---|---|\n");
  for (const std::string& row : summary) std::printf("%s\n", row.c_str());
  return bench::ExitStatus(failed);
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
