// The multi-controller baseline (issue 14, the paper's Figure 5 comparison): N processes, each
// driving its own devices with the same compiled functions and the same collectives as this
// runtime's workers, with no controller, no scheduler and no client: every process runs the same
// program, as JAX multi-controller programs do. Processes meet through a directory (a file per
// key) instead of the controller's rendezvous.
//
//   multicontroller_peer RANK RANKS DEVICES STORE_DIR BYTES STEPS REPEATS [WORK]
//
// A step is all_reduce(max) of BYTES per device then an add, each step's result feeding the
// next, with a WORK x WORK matrix product when WORK > 0 (collective_bench's step, from
// figure_step.h). Rank 0 prints, per repeat, "steps_per_s_step R" (one call of
// the compiled step per step: what each process dispatches itself) and "steps_per_s_fused R"
// (one call of a body that loops the steps). With PW_FUSED_ONLY set in the environment of every
// rank, only the fused loop runs (to measure its CPU alone with `perf stat`).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/time/clock.h"
#include "collective/collective.h"
#include "compute/executable.h"
#include "compute/function_body.h"
#include "compute/function_cache.h"
#include "core/process.h"
#include "device/cpu_device.h"
#include "figure_step.h"
#include "peers/peer_process.h"

namespace pathways {
namespace {

int Main(int argc, char** argv) {
  InitServingProcess();
  int rank = 0, ranks = 0, devices = 0, steps = 0, repeats = 0, work = 0;
  int64_t bytes = 0;
  if ((argc != 8 && argc != 9) || !absl::SimpleAtoi(argv[1], &rank) || !absl::SimpleAtoi(argv[2], &ranks) ||
      !absl::SimpleAtoi(argv[3], &devices) || !absl::SimpleAtoi(argv[5], &bytes) || !absl::SimpleAtoi(argv[6], &steps) ||
      !absl::SimpleAtoi(argv[7], &repeats) || (argc == 9 && !absl::SimpleAtoi(argv[8], &work)) || ranks < 1 ||
      rank < 0 || rank >= ranks || devices < 1 || bytes < 4 || steps < 1 || repeats < 1 || work < 0 || work > 4096) {
    std::fprintf(stderr, "usage: multicontroller_peer RANK RANKS DEVICES STORE_DIR BYTES STEPS REPEATS [WORK]\n");
    return 2;
  }
  ConfigureComputeThreads(1);  // as workers do: one thread per device, and the caching allocator
  auto connected = bench::ConnectPeerHub(rank, argv[4]);
  if (!connected.ok()) {
    std::fprintf(stderr, "%s\n", connected.status().ToString().c_str());
    return 1;
  }
  collective::CollectiveHub& hub = **connected;
  auto shared_layout = bench::RankMajorLayout({static_cast<int64_t>(ranks) * devices}, {"x"}, ranks, devices);
  FunctionCache cache;
  FunctionBody step{FunctionBody::Kind::kTorchScript, "step", bench::StepSource(work), std::nullopt};
  FunctionBody fused{FunctionBody::Kind::kTorchScript, "fused", bench::FusedSource(steps, work), std::nullopt};
  auto step_exe = cache.Compile(step);
  auto fused_exe = cache.Compile(fused);
  if (!step_exe.ok() || !fused_exe.ok()) {
    std::fprintf(stderr, "%s\n", (step_exe.ok() ? fused_exe.status() : step_exe.status()).ToString().c_str());
    return 1;
  }
  const int64_t count = std::max<int64_t>(1, bytes / 4);
  const bool fused_only = getenv("PW_FUSED_ONLY") != nullptr;
  const std::string client = "multi-controller";
  std::vector<double> step_seconds(repeats + 1), fused_seconds(repeats + 1);
  absl::Status failure;
  absl::Mutex failure_mu;
  std::vector<std::thread> threads;
  for (int d = 0; d < devices; ++d) {
    threads.emplace_back([&, d] {
      CpuDevice device(d, std::max<int64_t>(64 << 20, 8 * bytes));
      BufferPtr a = *device.Allocate(DType::kF32, {count}), b = *device.Allocate(DType::kF32, {count});
      std::memset(a->data(), 0, a->byte_size());
      const int64_t shard = static_cast<int64_t>(rank) * devices + d;
      int64_t run = 0;
      auto call = [&](const Executable& exe) {
        collective::ShardCollectives collectives(hub, shared_layout, {&client, 0, run++, 0}, shard);
        collective::ScopedShardCollectives scope(&collectives);
        const DeviceBuffer* in[] = {a.get()};
        DeviceBuffer* out[] = {b.get()};
        absl::Status s = exe.Run(in, out);
        std::swap(a, b);
        return s;
      };
      for (int r = 0; r < repeats + 1; ++r) {  // the first round warms up
        absl::Status s;
        const absl::Time t0 = absl::Now();
        for (int i = 0; i < steps && s.ok() && !fused_only; ++i) s = call(**step_exe);
        const absl::Time t1 = absl::Now();
        if (s.ok()) s = call(**fused_exe);
        const absl::Time t2 = absl::Now();
        if (!s.ok()) {
          absl::MutexLock lock(&failure_mu);
          failure = s;
          return;
        }
        if (d == 0) {
          step_seconds[r] = absl::ToDoubleSeconds(t1 - t0);
          fused_seconds[r] = absl::ToDoubleSeconds(t2 - t1);
        }
      }
      const float expected = (fused_only ? 1.0f : 2.0f) * steps * (repeats + 1);
      if (reinterpret_cast<const float*>(a->data())[0] != expected) {
        absl::MutexLock lock(&failure_mu);
        failure = absl::InternalError(absl::StrCat("wrong result ", reinterpret_cast<const float*>(a->data())[0],
                                                   ", expected ", expected));
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!failure.ok()) {
    std::fprintf(stderr, "multicontroller_peer %d: %s\n", rank, failure.ToString().c_str());
    return 1;
  }
  if (rank == 0) {
    for (int r = 1; r <= repeats; ++r) {
      if (!fused_only) std::printf("steps_per_s_step %.1f\n", steps / step_seconds[r]);
      std::printf("steps_per_s_fused %.1f\n", steps / fused_seconds[r]);
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
