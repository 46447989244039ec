// The island's gang scheduler on its own (issue 14 item 4): gang runs over --hosts hosts from
// --clients client threads go through a real IslandScheduler into a sink that only counts what
// it is given, so what is measured is the scheduler itself, not the control graph, the hosts or
// the client library in front of it (scale_bench measures the whole path). Under proportional
// share, every host's done report for a run is delivered from a thread of its own as the run goes
// out, as hosts' reports come back through the control graph.
//
//   build/bin/scheduler_bench [--hosts 512] [--clients 4] [--runs 2000] (per client) [--batch 16]
//
// Prints runs per second, ops per second (a run is one op per host), the CPU this process spent
// per run, and the resident memory the scheduler added.
#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench_util.h"
#include "controller/island_scheduler.h"
#include "core/process.h"
#include "tools/flags.h"

namespace pathways {
namespace {

int64_t ResidentKb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return 0;
}

// Counts the ops it is given; with `reports`, queues each host's done report for the reporter.
class CountingSink : public ScheduledOpSink {
 public:
  explicit CountingSink(bool reports) : reports_(reports) {}
  Future<Unit> Push(const std::string&, rpc::ScheduledOp op) override {
    absl::MutexLock lock(&mu_);
    ++ops_;
    if (reports_ && op.op().run().report_done()) done_.push_back({op.client_id(), op.op().run().epoch()});
    return Future<Unit>::Ready(Unit{});
  }
  int64_t ops() {
    absl::MutexLock lock(&mu_);
    return ops_;
  }
  void WaitForOps(int64_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ops_ >= n; };
    mu_.Await(absl::Condition(&enough));
  }
  // Delivers the queued reports to `scheduler` until Stop.
  void Report(IslandScheduler& scheduler) {
    for (;;) {
      std::deque<std::pair<std::string, int64_t>> batch;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !done_.empty() || stop_; };
        mu_.Await(absl::Condition(&ready));
        if (done_.empty()) return;  // stopped
        batch.swap(done_);
      }
      for (const auto& [client, epoch] : batch) scheduler.Done(client, epoch, 100);
    }
  }
  void Stop() {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }

 private:
  const bool reports_;
  absl::Mutex mu_;
  int64_t ops_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::pair<std::string, int64_t>> done_ ABSL_GUARDED_BY(mu_);
};

struct Result {
  double runs_per_s, ops_per_s, cpu_us_per_run, added_mib;
};

Result Measure(SchedulingPolicy policy, int64_t hosts, int64_t clients, int64_t runs, int64_t batch) {
  std::vector<std::string> names;
  for (int64_t h = 0; h < hosts; ++h) names.push_back(absl::StrCat("10.0.", h / 256, ".", h % 256, ":7000"));
  const int64_t rss0 = ResidentKb();
  const bool share = policy == SchedulingPolicy::kProportionalShare;
  CountingSink sink(share);
  IslandScheduler scheduler(0, {.policy = policy}, sink);
  std::thread reporter([&] { sink.Report(scheduler); });
  const double cpu0 = bench::SelfCpuSeconds();
  const double wall = bench::Seconds([&] {
    std::vector<std::thread> threads;
    for (int64_t c = 0; c < clients; ++c) {
      threads.emplace_back([&, c] {
        const std::string client = absl::StrCat("client", c);
        for (int64_t first = 1; first <= runs; first += batch) {
          std::vector<rpc::GangRun> gang_runs;
          for (int64_t i = first; i < first + batch && i <= runs; ++i) {
            rpc::GangRun run;
            run.mutable_run()->set_epoch(i);
            for (const std::string& h : names) {
              rpc::HostSeq* hs = run.add_hosts();
              hs->set_host(h);
              hs->set_seq(i);
            }
            gang_runs.push_back(std::move(run));
          }
          if (!scheduler.Submit(client, 1.0 + static_cast<double>(c), std::move(gang_runs)).Await().ok()) std::abort();
        }
      });
    }
    for (auto& t : threads) t.join();
    sink.WaitForOps(clients * runs * hosts);  // under proportional share Submit returns once queued
  });
  const double cpu = bench::SelfCpuSeconds() - cpu0;
  const int64_t rss1 = ResidentKb();
  sink.Stop();
  reporter.join();
  const double total = static_cast<double>(clients * runs);
  return {total / wall, static_cast<double>(sink.ops()) / wall, cpu * 1e6 / total,
          static_cast<double>(rss1 - rss0) / 1024};
}

int Main(int argc, char** argv) {
  InitServingProcess();  // as the controller's process runs (mutex deadlock detection off, among others)
  const Flags flags = bench::FlagsOrExit(argc, argv, {"hosts", "clients", "runs", "batch", "repeats"});
  const int64_t hosts = bench::IntFlagOrExit(flags, "hosts", 512);
  const int64_t clients = bench::IntFlagOrExit(flags, "clients", 4);
  const int64_t runs = bench::IntFlagOrExit(flags, "runs", 2000);
  const int64_t batch = bench::IntFlagOrExit(flags, "batch", 16);
  const int64_t repeats = bench::IntFlagOrExit(flags, "repeats", 3);
  std::printf("### The island's gang scheduler alone: %lld hosts, %lld clients of %lld runs each (batches of %lld), "
              "median of %lld\n\n",
              static_cast<long long>(hosts), static_cast<long long>(clients), static_cast<long long>(runs),
              static_cast<long long>(batch), static_cast<long long>(repeats));
  std::printf("| policy | runs/s | host ops/s | CPU us per run (this process) | resident MiB added |\n");
  std::printf("|---|---|---|---|---|\n");
  for (SchedulingPolicy policy : {SchedulingPolicy::kFifo, SchedulingPolicy::kProportionalShare}) {
    std::vector<Result> results;
    for (int64_t r = 0; r < repeats; ++r) results.push_back(Measure(policy, hosts, clients, runs, batch));
    std::sort(results.begin(), results.end(),
              [](const Result& a, const Result& b) { return a.runs_per_s < b.runs_per_s; });
    const Result& m = results[results.size() / 2];
    std::printf("| %s | %.0f | %.0f | %.1f | %.1f |\n",
                policy == SchedulingPolicy::kFifo ? "FIFO" : "proportional share", m.runs_per_s, m.ops_per_s,
                m.cpu_us_per_run, m.added_mib);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
