// Input batches drawn ahead of the step, on a host thread beside the devices that consume them
// (the paper's Appendix C). The data sources are functions of (step, sequence), so the batch a
// shard will read next step is known: when a shard draws step k's batch, the draw of step k+1
// starts on the prefetcher's thread, and the next step's call finds it made (or waits for the one
// in progress rather than drawing twice). The device's stream then spends a copy, not a draw.
// What is held ahead is bounded in bytes as well as in batches, and host memory outside every
// device's budget: a batch larger than a quarter of the bound is not drawn ahead, the batches
// unused longest make room, and a batch dropped before its draw is drawn by its caller instead.
// A draw may fail (a data file that changed): one that failed ahead is drawn again by its caller,
// whose own failure is then the step's.
// Torch-free; the data ops of the compute layer use it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace pathways {

// Thread-safe. One per process (Global()); tests make their own.
class BatchPrefetcher {
 public:
  // Fills `out` (n tokens) with step `step` of the batch `key` names, or says why it could not.
  using Draw = std::function<absl::Status(uint64_t step, int64_t* out)>;

  explicit BatchPrefetcher(size_t max_batches = 256, size_t max_bytes = size_t{256} << 20);
  ~BatchPrefetcher();
  static BatchPrefetcher& Global();

  // Step `step` of the batch `key` names (a source and the shard's part of its batch), `n`
  // tokens, into `out`: taken from the prefetched draw when there is one, else drawn here. Then
  // the draw of step + 1 is queued for the host thread. Fails as the draw here failed.
  absl::Status Get(const std::string& key, uint64_t step, size_t n, const Draw& draw, int64_t* out);

  struct Stats {
    int64_t hits = 0;    // steps found drawn (or being drawn) ahead
    int64_t misses = 0;  // steps drawn by the caller
    int64_t bytes_ahead = 0;
  };
  Stats stats() const;

 private:
  struct Batch {
    uint64_t step = 0;
    size_t n = 0;
    bool ready = false;    // set under mu_ once drawn, or dropped; `tokens` never changes after
    bool dropped = false;  // made room for others before its draw, or its draw failed: its caller draws it
    std::vector<int64_t> tokens;
  };
  struct Job {
    std::string key;
    std::shared_ptr<Batch> batch;
    Draw draw;
  };
  void Run();
  bool HasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !jobs_.empty(); }

  const size_t max_batches_, max_bytes_;
  mutable absl::Mutex mu_;
  // The next step's batch per key, drawn or being drawn; oldest keys first in `order_`.
  std::map<std::string, std::shared_ptr<Batch>> ahead_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> order_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the batches in ahead_
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace pathways
