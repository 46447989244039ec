// Puts each client's ops back into the client's order on one host, whichever way they came.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/future.h"
#include "proto/pathways.pb.h"

namespace pathways {

// What ops that came early may hold, in bytes (their serialised size): a client sends ops ahead
// of runs the island has not scheduled yet, but not without bound.
struct OpSequencerLimits {
  size_t waiting_bytes_per_client = size_t{1} << 30;
  size_t waiting_bytes = size_t{4} << 30;  // all clients together
};

// Ops reach a host two ways: directly from their client (puts, frees, program registrations),
// and through the island scheduler (runs, in the island's order). Each op carries its place in
// its client's sequence for this host. The sequencer applies:
// - each client's ops in sequence order, so a run never overtakes an earlier Put or Free of
//   the same client, nor a later Free the run;
// - scheduled ops in the scheduler's order, each once its client's earlier ops are applied. A
//   scheduled op that waits holds back those behind it: that keeps every device of the island
//   running gang work in one order.
// All ops are applied one at a time, under the sequencer's lock, so a run's work is enqueued on
// all of the host's devices before the next run's.
//
// A client that goes away mid-sequence would hold the scheduled stream forever; a scheduled op
// whose predecessors have not come within `gap_timeout` goes ahead and the missing ops are
// refused when (if) they come. Thread-safe.
class OpSequencer {
 public:
  using ApplyFn = std::function<void(const std::string& client, const rpc::Op& op)>;
  // Called when a scheduled op retires a client (it went away), at that op's place in the
  // island's order, under the sequencer's lock (it must not call back into the sequencer).
  using RetireFn = std::function<void(const std::string& client)>;
  using Limits = OpSequencerLimits;
  // Called when a client's ops are skipped because they did not come within the gap timeout,
  // with why, under the sequencer's lock: what they were to make will be missing, and whoever
  // reads it should hear why.
  using SkipFn = std::function<void(const std::string& client, const absl::Status& why)>;
  OpSequencer(ApplyFn apply, RetireFn retire, absl::Duration gap_timeout, Limits limits = {},
              SkipFn skipped = nullptr);
  ~OpSequencer();

  // InvalidArgument for ops without a sequence number or with one already used, ResourceExhausted
  // for an op that would have to wait beyond the limits; the others are still applied in turn.
  absl::Status AddDirect(const std::string& client, std::vector<rpc::Op> ops);
  absl::Status AddScheduled(std::vector<rpc::ScheduledOp> ops);
  // Completes once the client's ops up to `seq` of `session` are applied (or skipped).
  Future<Unit> WhenApplied(const std::string& client, int64_t session, int64_t seq);
  // The clients it has ops or waiters of.
  std::vector<std::string> Clients();
  // The host is going: everyone waiting for ops fails with `why`, and so does every later wait.
  void FailWaiters(const absl::Status& why);

 private:
  struct ClientState {
    int64_t applied = 0;                // every op up to here is applied or skipped
    // Direct ops that came early, with the bytes charged to the limits for them (none for an op
    // that is next when it comes: it is applied at once).
    std::map<int64_t, std::pair<rpc::Op, size_t>> waiting;
    size_t waiting_bytes = 0;  // charged for this session's waiting ops
    std::multimap<int64_t, Promise<Unit>> waiters;
  };
  // Waiters to answer once the lock is released (their continuations may run inline).
  using Settlements = std::vector<std::pair<Promise<Unit>, absl::Status>>;
  static void Settle(Settlements& settle);
  // Applies scheduled ops, and what they unblock, as far as they can go.
  void DrainLocked(Settlements& settle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The client went away: its waiting ops are dropped, its waiters fail, and whatever it sends
  // later is refused.
  void DropClientLocked(const std::string& client, Settlements& settle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the client's direct ops that are next in its sequence.
  void AdvanceLocked(const std::string& client, ClientState& c, Settlements& settle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WatchGaps();

  const ApplyFn apply_;
  const RetireFn retire_;
  const SkipFn skipped_;
  // Takes the first waiting op of `c` out, and what was charged for it off the byte counts.
  rpc::Op TakeFirstWaitingLocked(const std::string& client, ClientState& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration gap_timeout_;
  const Limits limits_;
  absl::Mutex mu_;
  // Bytes of waiting ops by client (all its sessions), and in all.
  absl::flat_hash_map<std::string, size_t> waiting_bytes_ ABSL_GUARDED_BY(mu_);
  size_t total_waiting_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // By client and session: each session is its own sequence.
  absl::flat_hash_map<std::pair<std::string, int64_t>, ClientState> clients_ ABSL_GUARDED_BY(mu_);
  // Clients that went away, so that their late ops are refused; the oldest are forgotten beyond
  // kMaxRememberedDropped (a client id is random and never comes back).
  absl::flat_hash_map<std::string, absl::Status> dropped_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> dropped_order_ ABSL_GUARDED_BY(mu_);
  std::deque<rpc::ScheduledOp> scheduled_ ABSL_GUARDED_BY(mu_);
  absl::Time head_blocked_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // set once the host is going (FailWaiters)
  std::thread watchdog_;
};

}  // namespace pathways
