// A worker's resident memory against its device budget over cycles of filling its device and
// freeing it: each cycle puts arrays filling about 3/8 of the budget, computes `add_one` of each
// (outputs take another 3/8, libtorch temporaries come and go), fetches one, and drops them all.
// Prints the worker process's RSS 1.5 s after each cycle and its peak; see docs/benchmarks.md.
//
//   build/bin/memory_bench [--device-memory 512MiB] [--cycles 6]
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "bench_util.h"
#include "client/client.h"
#include "core/process.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

// A field of /proc/PID/status in MiB ("VmRSS", "VmHWM"); -1 when unreadable.
double StatusMiB(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;  // kB
  }
  return -1;
}

int Main(int argc, char** argv) {
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"device-memory", "cycles"});
  auto budget = ParseBytes(flags.Get("device-memory", "512MiB"));
  auto cycles = flags.GetInt("cycles", 6);
  if (!budget.ok() || *budget < (64 << 20) || *budget > (int64_t{8} << 30) || !cycles.ok() || *cycles < 1 ||
      *cycles > 100) {
    std::fprintf(stderr, "want --device-memory between 64MiB and 8GiB and --cycles between 1 and 100\n");
    return 2;
  }
  Subprocess controller, worker;
  auto address = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"});
  auto serving = address.ok() ? StartWorker(worker, {PATHWAYS_BINARY, "worker", "--controller", *address, "--devices",
                                                     "1", "--device-memory", std::to_string(*budget)})
                              : address.status();
  auto client = serving.ok() ? Client::Connect(*address) : serving.status();
  auto slice = client.ok() ? (*client)->CreateSlice({.mesh_shape = {1}}) : client.status();
  if (!slice.ok()) {
    std::fprintf(stderr, "%s\n", slice.status().ToString().c_str());
    return 1;
  }
  constexpr int kArrays = 6;
  const int64_t elements = *budget * 3 / 8 / kArrays / 4;
  const TensorSpec spec{DType::kF32, {elements}};
  CompiledFunction inc = *(*client)->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{""}}, {{""}}));
  HostArray ones = *HostArray::Create(DType::kF32, {elements});
  const double budget_mib = static_cast<double>(*budget) / (1 << 20);
  std::printf("One worker process, one device of %.0f MiB; each cycle fills 3/4 of it and frees it.\n\n",
              budget_mib);
  std::printf("| after cycle | worker RSS MiB | RSS - budget MiB |\n|---|---|---|\n");
  std::printf("| (idle, before) | %.0f | %.0f |\n", StatusMiB(worker.pid(), "VmRSS"),
              StatusMiB(worker.pid(), "VmRSS") - budget_mib);
  bench::RowProgress progress("fill and free", *cycles);  // on a terminal, on stderr
  for (int64_t c = 1; c <= *cycles; ++c) {
    progress.Measuring(absl::StrCat("cycle ", c, " of ", *cycles));
    {
      std::vector<ShardedArray> inputs, outputs;
      for (int i = 0; i < kArrays; ++i) inputs.push_back(*(*client)->Put(ones, *slice, {""}));
      for (const ShardedArray& x : inputs) outputs.push_back((*(*client)->Call(inc, *slice, {x}))[0]);
      auto fetched = (*client)->Fetch(outputs.back()).Await();
      if (!fetched.ok()) {
        std::fprintf(stderr, "cycle %lld: %s\n", static_cast<long long>(c), fetched.status().ToString().c_str());
        return 1;
      }
    }
    // The frees reach the worker in order with later ops: a status-only read after them.
    (void)(*client)->Ready(*(*client)->Put(*HostArray::Create(DType::kF32, {1}), *slice, {""})).Await();
    // What the worker holds once settled: its allocator hands free memory back once a second.
    absl::SleepFor(absl::Milliseconds(1500));
    const double rss = StatusMiB(worker.pid(), "VmRSS");
    progress.Printing();
    std::printf("| %lld | %.0f | %.0f |\n", static_cast<long long>(c), rss, rss - budget_mib);
    std::fflush(stdout);
  }
  std::printf("\nPeak RSS of the worker: %.0f MiB (budget %.0f MiB).\n", StatusMiB(worker.pid(), "VmHWM"),
              budget_mib);
  client->reset();
  worker.Terminate(absl::Seconds(30));
  controller.Terminate(absl::Seconds(30));
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
