// Runs over several islands, in one order on all of them.
//
// Each island's gang scheduler orders the runs on its devices (island_scheduler.h). A run whose
// gang spans several islands needs more: two such runs ordered one way on one island and the
// other way on another would wait on each other in their collectives. So each island's scheduler
// reaches its part of such a run in its own order, under its own policy (FIFO or proportional
// share), and then holds it, and the client's later runs on that island, instead of sending it.
// Once every island has reached its part, the parts go to their hosts together, one such run at
// a time in the whole cluster: any two runs over the same islands are then in one order on each.
// Runs within one island never wait for this.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace pathways {

// Sends completed runs one at a time, in the order they completed. One per controller.
// Thread-safe.
class CrossIslandOrder {
 public:
  // Runs every `send` of a run whose parts have all been reached, after the runs completed before
  // it. A send may complete other runs (it releases more of its island's queue): those are queued
  // and sent by the same thread after it, never nested.
  void Ready(std::vector<std::function<void()>> sends);
  // Sends nothing from now on, once the sends under way are done: the schedulers the sends call
  // are about to go.
  void Close();

 private:
  absl::Mutex mu_;
  std::deque<std::vector<std::function<void()>>> ready_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// One run over several islands: which of its parts have been reached. Thread-safe; shared by the
// schedulers of its islands.
class CrossIslandRun {
 public:
  CrossIslandRun(CrossIslandOrder& order, int parts) : order_(order), left_(parts) {}

  // An island's scheduler reached its part: `send` pushes the part to the island's hosts,
  // `cancel` drops it (the client went away). Called without the scheduler's lock.
  void Reached(std::function<void()> send, std::function<void(absl::Status)> cancel);
  // The client went away: the parts reached are dropped, and so are those reached later.
  void Cancel(const absl::Status& why);

 private:
  CrossIslandOrder& order_;
  absl::Mutex mu_;
  int left_ ABSL_GUARDED_BY(mu_);
  absl::Status cancelled_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> sends_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(absl::Status)>> cancels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
