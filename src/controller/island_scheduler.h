// One gang scheduler per island (paper §4.4): every run on the island's devices, from every
// program of every client, goes through it and reaches the island's hosts in one order.
#pragma once

#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "controller/cross_island.h"
#include "core/future.h"
#include "proto/pathways.pb.h"
#include "transport/ordered_batch_queue.h"

namespace pathways {

enum class SchedulingPolicy {
  // Runs go to the hosts in the order they arrive.
  kFifo,
  // Device time is shared in proportion to client weights: start-time fair queuing over each
  // client's runs, costed by the device time its recent runs took, with only `window` of
  // estimated device time released ahead of what hosts have reported done.
  kProportionalShare,
};

struct IslandSchedulerOptions {
  SchedulingPolicy policy = SchedulingPolicy::kFifo;
  // Proportional share: smaller gives finer shares, larger keeps devices busier.
  absl::Duration window = absl::Milliseconds(2);
  // Proportional share: a run whose hosts have not all reported done by then stops counting
  // against the window (a report lost with its host must not stall the island).
  absl::Duration done_timeout = absl::Seconds(2);
  // The largest weight a client may state (clients choose their own): an operator bounds what
  // one tenant can claim over the others. Runs of a client stating more are refused.
  double max_client_weight = 1e6;
};

// Where the scheduler's ops go (the island control graph in the controller, memory in tests).
// Thread-safe.
class ScheduledOpSink {
 public:
  virtual ~ScheduledOpSink() = default;
  // Applied in the order pushed per host; the future completes once the host accepted it.
  virtual Future<Unit> Push(const std::string& host, rpc::ScheduledOp op) = 0;
  // The ops pushed since the last call were released together: they may travel as one round.
  virtual void EndRound() {}
};

// Why one order suffices: each host applies the island's runs in the order the scheduler sends
// them, and enqueues each run's work on its devices as it applies it, so every device of the
// island sees gang work in one total order; gangs that share devices then enter their
// collectives in the same order everywhere and cannot wait on each other in a cycle.
// Thread-safe.
class IslandScheduler {
 public:
  IslandScheduler(int island, IslandSchedulerOptions options, ScheduledOpSink& sink);
  ~IslandScheduler();

  // A released run's wait at the scheduler lands in the first bucket whose bound (microseconds)
  // is not below it, or in the last, beyond every bound (SchedulerStatus).
  static constexpr double kReleaseWaitBoundsUs[] = {100, 1000, 5000, 10000, 50000, 100000, 500000, 1000000, 5000000};
  static constexpr size_t kReleaseWaitBuckets = std::size(kReleaseWaitBoundsUs) + 1;

  int island() const { return island_; }
  // Queues a client's runs, in the client's order. `weight` (> 0) is the client's share under
  // proportional share. Completes once the scheduler has taken the runs: under FIFO, once every
  // host of every run has them; under proportional share, once they are queued here (up to 256
  // per client; beyond that, once they go out). With `across`, `runs` is this island's part of a
  // run over several islands: once reached it waits, with the client's later runs here, until
  // every island has reached its part (see cross_island.h).
  Future<Unit> Submit(const std::string& client, double weight, std::vector<rpc::GangRun> runs,
                      std::shared_ptr<CrossIslandRun> across = nullptr);
  // The client went away: its runs still held here are dropped (their submitters hear
  // Cancelled), and every host in `hosts` is told to collect the client after the runs it was
  // already sent, so all of them stop at the same point of the island's order.
  void RetireClient(const std::string& client, const std::vector<std::string>& hosts);
  // A host reports that its part of a run is done, and the device time it took per device.
  void Done(const std::string& client, int64_t epoch, int64_t device_us);
  // What it holds and has released, for status pages and metrics (`rounds` is left to the
  // caller, who knows the sink). Client ids appear in full.
  rpc::SchedulerStatus Status() const;

 private:
  struct Pending {
    rpc::GangRun run;
    Promise<Unit> accepted;
    std::shared_ptr<CrossIslandRun> across;  // this island's part of a run over several
    absl::Time submitted = absl::Now();
  };
  struct ClientQueue {
    double weight = 1;
    double finish = 0;  // virtual finish time of its last released run
    double estimate_us = 100;
    bool measured = false;  // estimate_us comes from its own runs
    std::deque<Pending> pending;
    // A part of a run over several islands that this island reached and holds: the client's
    // later runs wait behind it.
    std::shared_ptr<CrossIslandRun> holding;
    int64_t released = 0;
  };
  struct Outstanding {
    std::string client;
    int hosts_left;
    int64_t max_device_us = 0;
    double estimate_us;
    absl::Time released;
  };
  // Runs sent to hosts: each submitter's promise, and the hosts' acknowledgements it waits for.
  using Sent = std::vector<std::pair<Promise<Unit>, std::vector<Future<Unit>>>>;
  // Parts of runs over several islands that this island reached, to report once unlocked.
  using Reached = std::vector<std::pair<std::string, Pending>>;
  // Sends runs while the policy allows.
  void ReleaseLocked(Sent& sent, Reached& reached) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells each part's CrossIslandRun it was reached (called without mu_).
  void Report(Reached reached);
  // Every island reached the part: it goes to this island's hosts now, and the client's runs
  // behind it may follow.
  void SendPart(const std::string& client, const rpc::GangRun& run, std::shared_ptr<Promise<Unit>> accepted);
  std::vector<Future<Unit>> SendLocked(const std::string& client, const rpc::GangRun& run, bool report_done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Proportional share: the run goes out now and counts against the window until reported done.
  void OutstandingLocked(const std::string& client, const rpc::GangRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a run leaving its client's queue.
  void NoteReleasedLocked(ClientQueue& q, const Pending& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Settles each submitter's promise once its hosts acknowledged (called without mu_).
  static void Wire(Sent sent);
  void ExpireLoop();

  const int island_;
  const IslandSchedulerOptions options_;
  ScheduledOpSink& sink_;
  mutable absl::Mutex mu_;  // held while pushing to hosts' queues: that is what makes one order
  absl::flat_hash_map<std::string, ClientQueue> clients_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, int64_t>, Outstanding> outstanding_ ABSL_GUARDED_BY(mu_);
  double outstanding_us_ ABSL_GUARDED_BY(mu_) = 0;
  double virtual_time_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t released_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t release_wait_us_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t release_wait_buckets_[kReleaseWaitBuckets] ABSL_GUARDED_BY(mu_) = {};
  std::thread expirer_;  // proportional share only
};

}  // namespace pathways
