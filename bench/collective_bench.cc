// Collective throughput, the paper's Figure 5 step (an all_reduce, then an add, each step feeding
// the next), on real processes over loopback: this runtime (OpByOp, Chained, Fused) beside a
// multi-controller baseline on the same kernels and collectives (peers/multicontroller_peer.cc),
// torch.distributed with Gloo and OpenMPI over TCP, in one run. Also a memcpy measurement of
// this machine, the bound for collectives among devices of one host. OpenMPI runs twice: over its
// own TCP transport and over UCX's. Prints markdown tables; see
// docs/benchmarks.md. The peers come from `make deps-bench`; a missing one is reported, not fatal.
//
//   build/bin/collective_bench [--configs 2x1,4x1,8x1,4x4,1x4] [--sizes 4,64KiB,4MiB] [--repeats 3]
//                              [--rounds 1] [--hub-only true] [--runtime-only true] [--work 0,64,128,256]
//                              [--steps N] [--small-hosts 3,4,8,16]
//
// With --small-hosts, all_to_all, all_gather and broadcast between that many hosts instead, each
// by its two algorithms for small messages side by side (cross_host.h, SmallAlgorithm).
// With --work, Figure 6 instead: the step with a matrix product of each side given, at the first
// size, against the multi-controller baseline only.
//
// With --rounds R, each row of the main table measures every system R times in turn, the order
// turning by one system per round, and reports medians over the rounds, each ratio taken within
// a round (the machine's drift over a row then falls on every system alike).
//
// A config HxD is H worker processes with D devices each; sizes are bytes per device. The step
// reduces with max (values stay exact, so the result is checked) at the cost of a sum.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench_util.h"
#include "chain.h"
#include "client/client.h"
#include "client/program.h"
#include "collective/collective.h"
#include "collective/cross_host.h"
#include "collective/tcp_links.h"
#include "core/process.h"
#include "core/status_macros.h"
#include "figure_step.h"
#include "process_cluster.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::ExitStatus;
using bench::Median;
using bench::ProcessCluster;
using bench::ProcessCpuSeconds;
using bench::Seconds;
using bench::SelfCpuSeconds;

using bench::StepsFor;

struct Rates {
  double opbyop = 0, chained = 0, fused = 0;
  // CPU microseconds per step of each form (OpByOp, Chained, Fused), medians over the repeats:
  // the client's process, the controller's, and every worker's together.
  struct Cpu {
    double client = 0, controller = 0, workers = 0;
  };
  Cpu cpu[3];
};

// `steps_override` > 0 replaces the steps per run (a long run to profile one form with `perf`).
absl::StatusOr<Rates> MeasureRuntime(int hosts, int devices, int64_t bytes, int repeats, int work = 0,
                                     int steps_override = 0) {
  const int members = hosts * devices;
  const int64_t per_device = std::max<int64_t>(1, bytes / 4);
  ProcessCluster cluster;
  PW_RETURN_IF_ERROR(cluster.Start(PATHWAYS_BINARY, hosts, devices, std::max<int64_t>(64 << 20, 8 * bytes)));
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(cluster.address()));
  PW_ASSIGN_OR_RETURN(VirtualSlice slice, client->CreateSlice({.mesh_shape = {members}}));
  const TensorSpec spec{DType::kF32, {members * per_device}};
  const int steps = steps_override > 0 ? steps_override : StepsFor(bytes, work);
  PW_ASSIGN_OR_RETURN(CompiledFunction step, client->Compile(FunctionSpec::Script("step", bench::StepSource(work),
                                                                                  {spec}, {spec}, {{"x"}}, {{"x"}})));
  PW_ASSIGN_OR_RETURN(CompiledFunction fused,
                      client->Compile(FunctionSpec::Script("fused", bench::FusedSource(steps, work), {spec}, {spec},
                                                           {{"x"}}, {{"x"}})));
  PW_ASSIGN_OR_RETURN(Program chain, bench::ChainOf("chain", step, slice, spec, steps));
  PW_ASSIGN_OR_RETURN(HostArray zeros, HostArray::Create(DType::kF32, {members * per_device}));
  PW_ASSIGN_OR_RETURN(ShardedArray x, client->Put(zeros, slice, {"x"}));
  float expected = 0;
  // A run is timed until its result is ready on the devices, as the peers time theirs; the
  // values are fetched and checked after the clock stops (a fetch of the whole array through
  // the client would otherwise be timed too: at 4 MiB per device it took longer than the steps).
  auto ready = [&](absl::Status& failure) {
    absl::Status s = client->Ready(x).Await().status();
    if (!s.ok() && failure.ok()) failure = s;
  };
  auto check = [&](absl::Status& failure) {
    if (!failure.ok()) return;
    auto out = client->Fetch(x).Await();
    if (!out.ok()) {
      failure = out.status();
    } else if (out->data<float>()[0] != expected || out->data<float>()[members * per_device - 1] != expected) {
      failure = absl::InternalError(absl::StrCat("wrong result ", out->data<float>()[0], ", expected ", expected));
    }
  };
  std::vector<double> opbyop, chained, fused_rate;
  std::vector<double> cpu[3][3];  // form, then client / controller / workers
  // Times `body` (one form's run of `steps` steps) and notes each process's CPU per step.
  auto timed = [&](int form, bool keep, const std::function<void()>& body) {
    const double client0 = SelfCpuSeconds(), controller0 = ProcessCpuSeconds(cluster.controller_pid()),
                 workers0 = cluster.WorkersCpuSeconds();
    const double t = Seconds(body);
    if (keep) {
      cpu[form][0].push_back((SelfCpuSeconds() - client0) * 1e6 / steps);
      cpu[form][1].push_back((ProcessCpuSeconds(cluster.controller_pid()) - controller0) * 1e6 / steps);
      cpu[form][2].push_back((cluster.WorkersCpuSeconds() - workers0) * 1e6 / steps);
    }
    return t;
  };
  absl::Status failure;
  // The next step's input is this step's output, or the run stops at the first failure.
  auto advance = [&](const absl::StatusOr<std::vector<ShardedArray>>& out) {
    if (out.ok()) {
      x = (*out)[0];
    } else {
      failure = out.status();
    }
  };
  for (int r = 0; r < repeats + 1 && failure.ok(); ++r) {  // the first round warms up
    const bool keep = r > 0;
    const double t1 = timed(0, keep, [&] {
      for (int i = 0; i < steps && failure.ok(); ++i) {
        advance(client->Call(step, slice, {x}));
      }
      ready(failure);
    });
    expected += steps;
    check(failure);
    const double t2 = timed(1, keep, [&] {
      advance(client->Run(chain, {x}));
      ready(failure);
    });
    expected += steps;
    check(failure);
    const double t3 = timed(2, keep, [&] {
      advance(client->Call(fused, slice, {x}));
      ready(failure);
    });
    expected += steps;
    check(failure);
    if (r == 0) continue;
    opbyop.push_back(steps / t1);
    chained.push_back(steps / t2);
    fused_rate.push_back(steps / t3);
  }
  PW_RETURN_IF_ERROR(failure);
  Rates rates{Median(opbyop), Median(chained), Median(fused_rate)};
  for (int f = 0; f < 3; ++f) rates.cpu[f] = {Median(cpu[f][0]), Median(cpu[f][1]), Median(cpu[f][2])};
  return rates;
}

// The median of the "steps_per_s" lines a peer printed.
std::optional<double> ParseRates(const std::string& out) {
  std::vector<double> rates;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    double rate;
    if (absl::ConsumePrefix(&line, "steps_per_s ") && absl::SimpleAtod(line, &rate)) rates.push_back(rate);
  }
  if (rates.empty()) return std::nullopt;
  return Median(rates);
}

bool Available(const std::vector<std::string>& argv) { return RunCommand(argv, absl::Seconds(120)).ok(); }

std::optional<double> MeasureTorch(int ranks, int64_t bytes, int repeats) {
  auto lines = bench::RunPeerRanks(
      ranks,
      [&](int r, const std::string& dir) -> std::vector<std::string> {
        // env(1) sets the rank; Gloo is told to use loopback.
        return {"/usr/bin/env", absl::StrCat("RANK=", r), absl::StrCat("WORLD_SIZE=", ranks), "GLOO_SOCKET_IFNAME=lo",
                "OMP_NUM_THREADS=1", "/usr/bin/python3", TORCH_PEER, "--bytes", std::to_string(bytes), "--steps",
                std::to_string(StepsFor(bytes)), "--repeats", std::to_string(repeats), "--store", dir + "/store"};
      },
      repeats, absl::Seconds(300));
  if (!lines.ok()) {
    std::fprintf(stderr, "torch.distributed: %s\n", std::string(lines.status().message()).c_str());
    return std::nullopt;
  }
  const std::string out = absl::StrJoin(*lines, "\n");
  return ParseRates(out);
}

// OpenMPI's own point-to-point layer over its TCP transport (ob1 with btl tcp), or UCX's (pml ucx
// with UCX's tcp transport; Debian's OpenMPI is built with UCX, which selects itself only on
// RDMA hardware unless told any transport will do). Both without shared memory between ranks,
// as between machines: the comparison that says whether UCX would carry our collectives better
// than our own sockets (docs/benchmarks.md, "UCX").
enum class MpiTransport { kTcp, kUcx };
std::optional<double> MeasureMpi(int ranks, int64_t bytes, int repeats, MpiTransport transport) {
  std::vector<std::string> argv = {"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe"};
  if (transport == MpiTransport::kTcp) {
    argv.insert(argv.end(), {"--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"});
  } else {
    argv.insert(argv.end(), {"--mca", "pml", "ucx", "--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any",
                             "-x", "UCX_TLS=tcp,self", "-x", "UCX_NET_DEVICES=lo"});
  }
  argv.insert(argv.end(), {"-np", std::to_string(ranks), MPI_PEER, std::to_string(bytes),
                           std::to_string(StepsFor(bytes)), std::to_string(repeats)});
  auto out = RunCommand(argv, absl::Seconds(600));
  if (!out.ok()) return std::nullopt;
  return ParseRates(*out);
}

// The multi-controller baseline (peers/multicontroller_peer.cc): `hosts` processes of `devices`
// devices each, the same compiled step and collectives, no controller. Steps per second with
// one call per step, and with the fused loop.
struct MultiControllerRates {
  std::optional<double> step, fused;
};
MultiControllerRates MeasureMultiController(int hosts, int devices, int64_t bytes, int repeats, int work = 0) {
  auto lines = bench::RunPeerRanks(
      hosts,
      [&](int r, const std::string& dir) -> std::vector<std::string> {
        return {MC_PEER, std::to_string(r), std::to_string(hosts), std::to_string(devices), dir, std::to_string(bytes),
                std::to_string(StepsFor(bytes, work)), std::to_string(repeats), std::to_string(work)};
      },
      2 * repeats, absl::Seconds(300));
  if (!lines.ok()) {
    std::fprintf(stderr, "the multi-controller peer: %s\n", std::string(lines.status().message()).c_str());
    return {};
  }
  const std::string out = absl::StrJoin(*lines, "\n");
  MultiControllerRates rates;
  std::vector<double> step, fused;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    double rate;
    if (absl::ConsumePrefix(&line, "steps_per_s_step ") && absl::SimpleAtod(line, &rate)) step.push_back(rate);
    if (absl::ConsumePrefix(&line, "steps_per_s_fused ") && absl::SimpleAtod(line, &rate)) fused.push_back(rate);
  }
  if (!step.empty()) rates.step = Median(step);
  if (!fused.empty()) rates.fused = Median(fused);
  return rates;
}

// Collective links for hosts "host0" .. "host{n-1}", threads of this process, meeting through a
// store in memory: none when one could not listen.
std::vector<std::unique_ptr<collective::TcpLinks>> LoopbackLinks(int n) {
  auto store = std::make_shared<collective::InMemoryKeyValueStore>();
  std::vector<std::unique_ptr<collective::TcpLinks>> links;
  for (int h = 0; h < n; ++h) {
    auto l = collective::TcpLinks::Create(absl::StrCat("host", h), "127.0.0.1", store);
    if (!l.ok()) return {};
    links.push_back(*std::move(l));
  }
  return links;
}

// The collective alone, through the runtime's hub API with no compiled function around it: H
// hosts of D members as threads of this process, each host with its own hub and loopback links.
// Returns all_reduce calls per second.
double MeasureHubOnly(int hosts, int devices, int64_t bytes, int repeats) {
  std::vector<std::unique_ptr<collective::TcpLinks>> links = LoopbackLinks(hosts);
  if (links.empty()) return 0;
  std::vector<std::unique_ptr<collective::CollectiveHub>> hubs;
  collective::GangLayout layout{{hosts * devices}, {"x"}, {}};
  for (int h = 0; h < hosts; ++h) {
    const std::string name = absl::StrCat("host", h);
    hubs.push_back(std::make_unique<collective::CollectiveHub>(name, std::move(links[h]), absl::Seconds(60)));
    for (int d = 0; d < devices; ++d) layout.members.push_back({name, DeviceId(h * devices + d)});
  }
  auto shared_layout = std::make_shared<const collective::GangLayout>(layout);
  const size_t count = static_cast<size_t>(std::max<int64_t>(1, bytes / 4));
  const int calls = StepsFor(bytes);
  std::vector<double> rates;
  for (int r = 0; r < repeats + 1; ++r) {
    const std::string execution = absl::StrCat("hub-only-", r);
    std::vector<std::thread> threads;
    const double t = Seconds([&] {
      for (int m = 0; m < hosts * devices; ++m) {
        threads.emplace_back([&, m] {
          std::vector<float> in(count, 1.0f), out(count);
          collective::ShardCollectives shard(*hubs[m / devices], shared_layout, {&execution, 0, 0, 0}, m);
          for (int i = 0; i < calls; ++i) {
            collective::CollectiveCall call{collective::CollectiveKind::kAllReduce,
                                            DType::kF32,
                                            collective::ReduceOp::kMax,
                                            0,
                                            count,
                                            reinterpret_cast<const char*>(in.data()),
                                            reinterpret_cast<char*>(out.data())};
            if (!shard.Run("x", call).ok()) std::abort();
          }
        });
      }
      for (auto& th : threads) th.join();
    });
    if (r > 0) rates.push_back(calls / t);
  }
  return Median(rates);
}

// all_to_all, all_gather or broadcast between `hosts` hosts of one member each (threads of this
// process over loopback links) by `algorithm`, `bytes` per block (all_to_all), per host's
// segment (all_gather) or in all (broadcast, from host 0): calls per second, median of
// `repeats`, or 0 when a call failed or delivered the wrong bytes.
double MeasureSmall(collective::CollectiveKind kind, int hosts, int64_t bytes, collective::SmallAlgorithm algorithm,
                    int repeats) {
  std::vector<std::unique_ptr<collective::TcpLinks>> links = LoopbackLinks(hosts);
  if (links.empty()) return 0;
  std::vector<std::string> names;
  for (int h = 0; h < hosts; ++h) names.push_back(absl::StrCat("host", h));
  const size_t n = static_cast<size_t>(bytes);
  const bool broadcast = kind == collective::CollectiveKind::kBroadcast;
  const int calls = StepsFor(bytes * (broadcast ? 1 : hosts));
  std::vector<double> rates;
  for (int r = 0; r < repeats + 1; ++r) {  // the first connects the meshes and warms up
    std::vector<std::thread> threads;
    std::atomic<bool> failed = false;
    const double t = Seconds([&] {
      for (int h = 0; h < hosts; ++h) {
        threads.emplace_back([&, h] {
          // Host h's bytes are h: every part received names its sender.
          std::vector<char> in(n * hosts, static_cast<char>(h)), out(n * hosts, static_cast<char>(h));
          std::vector<std::vector<collective::Piece>> send(hosts), recv(hosts);
          for (int g = 0; g < hosts; ++g) {
            send[g] = {{in.data() + g * n, n}};
            recv[g] = {{out.data() + g * n, n}};
          }
          for (int i = 0; i < calls && !failed; ++i) {
            const collective::CallId id{static_cast<uint64_t>(r + 1), static_cast<uint32_t>(i)};
            absl::Status s = links[h]->Run(names, h, "small", id, absl::Now() + absl::Seconds(60), [&](auto& mesh) {
              collective::MeshSteps steps(mesh, id, 1, absl::Now() + absl::Seconds(60));
              switch (kind) {
                case collective::CollectiveKind::kAllGather:
                  return collective::AllGatherAcrossHosts(steps, recv, algorithm);
                case collective::CollectiveKind::kBroadcast:
                  return collective::BroadcastAcrossHosts(steps, 0, out.data(), n, algorithm);
                default:
                  return collective::AllToAllAcrossHosts(
                      steps, send, recv, [&](int, int) { return n; }, algorithm);
              }
            });
            if (!s.ok()) {
              std::fprintf(stderr, "%s, host %d: %s\n", collective::CollectiveName(kind), h,
                           std::string(s.message()).c_str());
              failed = true;
            }
          }
          for (int g = 0; g < hosts && !failed; ++g) {
            if (out[g * n] != static_cast<char>(broadcast ? 0 : g)) failed = true;
            if (broadcast) break;
          }
        });
      }
      for (auto& th : threads) th.join();
    });
    if (failed) return 0;
    if (r > 0) rates.push_back(calls / t);
  }
  return Median(rates);
}

int SmallTable(const std::vector<int>& hosts, const std::vector<int64_t>& sizes, int repeats) {
  std::printf(
      "Small messages between hosts (threads of one process, loopback links, one member each): one round of "
      "direct sends against log2(H) rounds, calls per second, median of %d runs. Bytes are one host's block "
      "for another (all_to_all), one host's segment (all_gather), the whole buffer (broadcast).\n\n"
      "| collective | hosts | bytes | direct | log rounds | log/direct | the runtime picks |\n"
      "|---|---|---|---|---|---|---|\n",
      repeats);
  int failed = 0;
  using collective::CollectiveKind;
  using collective::SmallAlgorithm;
  for (CollectiveKind kind : {CollectiveKind::kAllToAll, CollectiveKind::kAllGather, CollectiveKind::kBroadcast}) {
    for (int h : hosts) {
      for (int64_t bytes : sizes) {
        const double direct = MeasureSmall(kind, h, bytes, SmallAlgorithm::kDirect, repeats);
        const double log_rounds = MeasureSmall(kind, h, bytes, SmallAlgorithm::kLogRounds, repeats);
        failed += (direct == 0) + (log_rounds == 0);
        // Past kLargeMessageBytes in all, all_gather and broadcast take a ring whichever is asked.
        const int64_t total = kind == CollectiveKind::kAllGather ? bytes * h : bytes;
        const SmallAlgorithm picked = kind == CollectiveKind::kAllToAll
                                          ? collective::ChooseAllToAll(h, static_cast<size_t>(bytes))
                                          : collective::ChooseSmall(h);
        const char* picks =
            kind != CollectiveKind::kAllToAll && h > 2 && total >= int64_t{collective::kLargeMessageBytes} ? "ring"
            : picked == SmallAlgorithm::kLogRounds ? "log rounds"
                                                   : "direct";
        std::printf("| %s | %d | %lld | %.0f | %.0f | %.2f | %s |\n", collective::CollectiveName(kind), h,
                    static_cast<long long>(bytes), direct, log_rounds, direct > 0 ? log_rounds / direct : 0.0, picks);
        std::fflush(stdout);
      }
    }
  }
  return ExitStatus(failed);
}

// Bytes per second of memcpy between two 64 MiB buffers, counting what is read and written.
double MemcpyBandwidth() {
  const size_t n = 64 << 20;
  std::vector<char> a(n, 1), b(n, 2);
  std::vector<double> rates;
  for (int r = 0; r < 5; ++r) rates.push_back(2.0 * n / Seconds([&] { std::memcpy(b.data(), a.data(), n); }));
  return Median(rates);
}

std::string Format(std::optional<double> v) { return v ? absl::StrFormat("%.0f", *v) : "n/a"; }

// One round of a row of the main table: every system measured once, side by side.
struct RowRound {
  Rates ours;
  MultiControllerRates mc;
  std::optional<double> torch, mpi, mpi_ucx;
};

// The paper's Figure 6: the step with a computation of growing duration (a matrix product of
// side `work`), the single controller's forms against the multi-controller baseline, and per
// form the first step of the sweep (in the order given) at which the single controller reaches
// 95% of the baseline's rate.
int Figure6(const std::vector<std::pair<int, int>>& configs, int64_t bytes, const std::vector<int>& work, int repeats) {
  std::printf(
      "Figure 6: a step is a work x work matrix product, then all_reduce(max) of %lld bytes per device and an add. "
      "Steps per second, median of %d runs. The step time is the multi-controller's (one call per step). "
      "OpByOp and Chained are compared with the multi-controller's step-by-step calls, Fused with its fused loop.\n\n",
      static_cast<long long>(bytes), repeats);
  std::printf(
      "| hosts x devices | work | step ms (MC) | OpByOp | Chained | Fused | MC step | MC fused | OpByOp/MC | "
      "Chained/MC | Fused/MC fused |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  int failed = 0;
  for (auto [hosts, devices] : configs) {
    // The first multi-controller step (ms) of the sweep at which each form reached 95%.
    std::optional<double> cross[3];
    for (int n : work) {
      auto ours = MeasureRuntime(hosts, devices, bytes, repeats, n);
      const MultiControllerRates mc = MeasureMultiController(hosts, devices, bytes, repeats, n);
      if (!ours.ok() || !mc.step || !mc.fused) {
        std::printf("| %dx%d | %d | failed: %s |\n", hosts, devices, n,
                    ours.ok() ? "the multi-controller peer" : std::string(ours.status().message()).c_str());
        std::fflush(stdout);
        ++failed;
        continue;
      }
      const double step_ms = 1000.0 / *mc.step;
      const double ratios[3] = {ours->opbyop / *mc.step, ours->chained / *mc.step, ours->fused / *mc.fused};
      for (int f = 0; f < 3; ++f) {
        if (ratios[f] >= 0.95 && !cross[f]) cross[f] = step_ms;
      }
      std::printf("| %dx%d | %d | %.3f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.2f |\n", hosts, devices, n,
                  step_ms, ours->opbyop, ours->chained, ours->fused, *mc.step, *mc.fused, ratios[0], ratios[1],
                  ratios[2]);
      std::fflush(stdout);
    }
    auto at = [](const std::optional<double>& ms) {
      return ms ? absl::StrFormat("%.3f ms", *ms) : std::string("not within the sweep");
    };
    std::printf("\n%dx%d: 95%% of the multi-controller from a step of OpByOp %s, Chained %s, Fused %s\n\n", hosts,
                devices, at(cross[0]).c_str(), at(cross[1]).c_str(), at(cross[2]).c_str());
  }
  return ExitStatus(failed);
}

int Main(int argc, char** argv) {
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(
      argc, argv,
      {"configs", "sizes", "repeats", "rounds", "hub-only", "runtime-only", "work", "steps", "small-hosts"});
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 3));
  const int rounds = static_cast<int>(bench::IntFlagOrExit(flags, "rounds", 1, 1, 20));
  const std::vector<std::pair<int, int>> configs = bench::ConfigsOrExit(flags.Get("configs", "2x1,4x1,8x1,4x4,1x4"));
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(flags.Get("sizes", "4,64KiB,4MiB"), ',')) {
    auto bytes = ParseBytes(std::string(s));
    if (!bytes.ok() || *bytes < 4 || *bytes > (256 << 20)) {
      std::fprintf(stderr, "bad size '%s': want 4 B to 256 MiB\n", std::string(s).c_str());
      return 2;
    }
    sizes.push_back(*bytes);
  }
  if (repeats < 1 || repeats > 50) {
    std::fprintf(stderr, "--repeats must be between 1 and 50\n");
    return 2;
  }
  if (flags.Has("work") && flags.Has("steps")) {
    std::fprintf(stderr, "--steps is for this runtime's forms alone; Figure 6 (--work) sets its steps by the work\n");
    return 2;
  }
  if (flags.Has("small-hosts"))
    return SmallTable(bench::IntListFlagOrExit(flags, "small-hosts", 2, 64), sizes, repeats);
  if (flags.Has("work")) {
    const std::vector<int> work = bench::IntListFlagOrExit(flags, "work", 0, 4096);
    return Figure6(configs, sizes.front(), work, repeats);
  }
  const double memcpy_bw = MemcpyBandwidth();
  std::printf("memcpy on this machine: %.2f GB/s (bytes read + written)\n\n", memcpy_bw / 1e9);
  std::printf(
      "Steps per second, median of %d runs (then of %d rounds, each ratio taken within a round); a step is "
      "all_reduce(max) of the bytes per device, then an add; every rank is a process or a device of a worker "
      "process.\n\n",
      repeats, rounds);
  std::printf(
      "The collective alone: all_reduce through the hub API, hosts as threads of one process with "
      "loopback links between them, no compiled function; GB/s counts every member's input read and output "
      "written, against memcpy's bytes read and written.\n\n");
  const bool hub_only = flags.Get("hub-only", "false") == "true";
  // This runtime alone, no hub and no peers: for profiling it (`perf record -a`).
  const bool runtime_only = flags.Get("runtime-only", "false") == "true";
  // Steps per run of this runtime's forms instead of the size's default: with --runtime-only,
  // runs long enough for a profile of their steady state rather than of process start-up.
  const int steps = flags.Has("steps") ? static_cast<int>(bench::IntFlagOrExit(flags, "steps", 0, 1, 1000000)) : 0;
  const bool have_torch = !runtime_only && Available({"/usr/bin/python3", "-c", "import torch.distributed"});
  const bool have_mpi = !runtime_only && access(MPI_PEER, X_OK) == 0 && access("/usr/bin/mpirun", X_OK) == 0;
  if (!runtime_only && !have_torch) std::printf("torch.distributed: not installed (make deps-bench)\n\n");
  if (!runtime_only && !have_mpi) {
    std::printf("OpenMPI: not installed or peer not built (make deps-bench, then rebuild)\n\n");
  }
  // On a terminal, what is being measured (on stderr: the tables on stdout stay clean).
  bench::RowProgress progress(
      "measured", static_cast<int64_t>(configs.size() * sizes.size()) * (hub_only || runtime_only ? 1 : 2));
  auto now_measuring = [&](const char* what, int hosts, int devices, int64_t bytes) {
    progress.Measuring(absl::StrFormat("%s %dx%d, %lld B", what, hosts, devices, static_cast<long long>(bytes)));
  };
  if (!runtime_only) {
    std::printf("| hosts x devices | bytes/device | all_reduce/s | GB/s touched | of memcpy |\n|---|---|---|---|---|\n");
    for (auto [hosts, devices] : configs) {
      for (int64_t bytes : sizes) {
        now_measuring("hub only", hosts, devices, bytes);
        const double rate = MeasureHubOnly(hosts, devices, bytes, repeats);
        progress.Printing();
        const double touched = 2.0 * hosts * devices * static_cast<double>(bytes) * rate;
        std::printf("| %dx%d | %lld | %.0f | %.2f | %.0f%% |\n", hosts, devices, static_cast<long long>(bytes), rate,
                    touched / 1e9, 100 * touched / memcpy_bw);
        std::fflush(stdout);
      }
    }
    std::printf("\n");
  }
  if (hub_only) {
    progress.Finished();
    return 0;
  }
  std::printf(
      "| hosts x devices | bytes/device | OpByOp | Chained | Fused | multi-controller step | multi-controller fused | "
      "torch+Gloo | OpenMPI TCP | OpenMPI UCX | Fused/torch | Fused/MPI | Fused/MPI UCX | OpByOp/Fused | Chained/Fused | "
      "Chained/MC step | Fused/MC fused | Fused GB/s touched |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> cpu_rows;
  int failed = 0;
  for (auto [hosts, devices] : configs) {
    for (int64_t bytes : sizes) {
      now_measuring("this runtime and its peers", hosts, devices, bytes);
      const int ranks = hosts * devices;
      // Each round measures every system once (`repeats` runs each), in an order that turns by
      // one system per round: on this shared machine the rate drifts over a minute, and a system
      // measured always last, or always after the same one, would carry that drift into its
      // ratios. A ratio is taken within each round, and the median of the rounds reported.
      std::vector<RowRound> row;
      absl::Status ours_failed;
      for (int k = 0; k < rounds && ours_failed.ok(); ++k) {
        RowRound round;
        for (int i = 0; i < 5; ++i) {
          switch ((i + k) % 5) {
            case 0: {
              auto ours = MeasureRuntime(hosts, devices, bytes, repeats, 0, steps);
              if (ours.ok()) {
                round.ours = *ours;
              } else {
                ours_failed = ours.status();
              }
              break;
            }
            case 1:
              if (!runtime_only) round.mc = MeasureMultiController(hosts, devices, bytes, repeats);
              break;
            case 2:
              if (have_torch) round.torch = MeasureTorch(ranks, bytes, repeats);
              break;
            case 3:
              if (have_mpi) round.mpi = MeasureMpi(ranks, bytes, repeats, MpiTransport::kTcp);
              break;
            case 4:
              if (have_mpi) round.mpi_ucx = MeasureMpi(ranks, bytes, repeats, MpiTransport::kUcx);
              break;
          }
          if (!ours_failed.ok()) break;
        }
        // The peers from Debian may be missing (n/a); the multi-controller peer is ours and is built.
        if (ours_failed.ok() && !runtime_only && (!round.mc.step || !round.mc.fused)) ++failed;
        if (ours_failed.ok()) row.push_back(std::move(round));
      }
      if (!ours_failed.ok()) {
        progress.Printing();
        std::printf("| %dx%d | %lld | failed: %s |\n", hosts, devices, static_cast<long long>(bytes),
                    std::string(ours_failed.message()).c_str());
        std::fflush(stdout);
        ++failed;
        continue;
      }
      progress.Printing();
      auto median = [&](auto get) {  // over the rounds that have the figure
        std::vector<double> v;
        for (const RowRound& r : row) {
          if (std::optional<double> x = get(r)) v.push_back(*x);
        }
        return v.empty() ? std::nullopt : std::optional<double>(Median(v));
      };
      auto ratio = [&](auto num, auto den) {
        std::optional<double> m = median([&](const RowRound& r) -> std::optional<double> {
          const std::optional<double> d = den(r);
          if (!d || *d <= 0) return std::nullopt;
          return num(r) / *d;
        });
        return m ? absl::StrFormat("%.2f", *m) : std::string("n/a");
      };
      const double opbyop = *median([](const RowRound& r) { return std::optional(r.ours.opbyop); });
      const double chained = *median([](const RowRound& r) { return std::optional(r.ours.chained); });
      const double fused = *median([](const RowRound& r) { return std::optional(r.ours.fused); });
      auto fused_of = [](const RowRound& r) { return r.ours.fused; };
      auto chained_of = [](const RowRound& r) { return r.ours.chained; };
      // What an all_reduce must touch at least: every member's input read, every output written.
      const double touched = 2.0 * ranks * static_cast<double>(bytes) * fused / 1e9;
      std::printf(
          "| %dx%d | %lld | %.0f | %.0f | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f |\n",
          hosts, devices, static_cast<long long>(bytes), opbyop, chained, fused,
          Format(median([](const RowRound& r) { return r.mc.step; })).c_str(),
          Format(median([](const RowRound& r) { return r.mc.fused; })).c_str(),
          Format(median([](const RowRound& r) { return r.torch; })).c_str(),
          Format(median([](const RowRound& r) { return r.mpi; })).c_str(),
          Format(median([](const RowRound& r) { return r.mpi_ucx; })).c_str(),
          ratio(fused_of, [](const RowRound& r) { return r.torch; }).c_str(),
          ratio(fused_of, [](const RowRound& r) { return r.mpi; }).c_str(),
          ratio(fused_of, [](const RowRound& r) { return r.mpi_ucx; }).c_str(),
          ratio([](const RowRound& r) { return r.ours.opbyop; },
                [](const RowRound& r) { return std::optional(r.ours.fused); })
              .c_str(),
          ratio(chained_of, [](const RowRound& r) { return std::optional(r.ours.fused); }).c_str(),
          ratio(chained_of, [](const RowRound& r) { return r.mc.step; }).c_str(),
          ratio(fused_of, [](const RowRound& r) { return r.mc.fused; }).c_str(), touched);
      std::fflush(stdout);
      static const char* kForms[] = {"OpByOp", "Chained", "Fused"};
      const double rates[] = {opbyop, chained, fused};
      for (int f = 0; f < 3; ++f) {
        const Rates::Cpu c{*median([f](const RowRound& r) { return std::optional(r.ours.cpu[f].client); }),
                           *median([f](const RowRound& r) { return std::optional(r.ours.cpu[f].controller); }),
                           *median([f](const RowRound& r) { return std::optional(r.ours.cpu[f].workers); })};
        cpu_rows.push_back(absl::StrFormat("| %dx%d | %lld | %s | %.0f | %.0f | %.0f | %.0f | %.0f |", hosts, devices,
                                           static_cast<long long>(bytes), kForms[f], 1e6 / rates[f], c.client,
                                           c.controller, c.workers, c.client + c.controller + c.workers));
      }
    }
  }
  progress.Finished();
  if (!cpu_rows.empty()) {
    std::printf(
        "\nCPU per step of this runtime, microseconds (medians over the repeats; the client's process, the "
        "controller's, every worker's together), beside the wall time of a step:\n\n"
        "| hosts x devices | bytes/device | form | wall | client | controller | workers | all |\n"
        "|---|---|---|---|---|---|---|---|\n");
    for (const std::string& row : cpu_rows) std::printf("%s\n", row.c_str());
  }
  return ExitStatus(failed);
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
