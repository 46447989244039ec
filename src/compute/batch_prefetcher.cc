#include "compute/batch_prefetcher.h"

#include <cstring>

#include "core/executor.h"

namespace pathways {

BatchPrefetcher::BatchPrefetcher(size_t max_batches, size_t max_bytes)
    : max_batches_(max_batches), max_bytes_(max_bytes), thread_([this] {
        NameThisThread("prefetch");
        Run();
      }) {}

BatchPrefetcher::~BatchPrefetcher() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

BatchPrefetcher& BatchPrefetcher::Global() {
  static auto* prefetcher = new BatchPrefetcher();
  return *prefetcher;
}

absl::Status BatchPrefetcher::Get(const std::string& key, uint64_t step, size_t n, const Draw& draw, int64_t* out) {
  std::shared_ptr<Batch> ahead;
  {
    absl::MutexLock lock(&mu_);
    auto it = ahead_.find(key);
    if (it != ahead_.end() && it->second->step == step && it->second->n == n) {
      ahead = it->second;
      // Drawn, or being drawn on the host thread: wait for it rather than drawing twice.
      mu_.Await(absl::Condition(&ahead->ready));
      if (ahead->dropped) ahead = nullptr;
    }
    if (ahead != nullptr) {
      ++stats_.hits;
    } else {
      ++stats_.misses;
    }
  }
  if (ahead != nullptr) {
    std::memcpy(out, ahead->tokens.data(), n * sizeof(int64_t));
  } else if (absl::Status drawn = draw(step, out); !drawn.ok()) {
    return drawn;  // nothing is drawn ahead of a step that failed
  }
  // Step + 1, for the host thread, if it fits.
  const size_t bytes = n * sizeof(int64_t);
  if (bytes > max_bytes_ / 4) return absl::OkStatus();
  auto next = std::make_shared<Batch>();
  next->step = step + 1;
  next->n = n;
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::OkStatus();
  if (auto old = ahead_.find(key); old != ahead_.end()) {
    bytes_ -= old->second->n * sizeof(int64_t);
    old->second = next;
  } else {
    ahead_.emplace(key, next);
    order_.push_back(key);
  }
  bytes_ += bytes;
  while ((ahead_.size() > max_batches_ || bytes_ > max_bytes_) && !order_.empty()) {  // unused longest go
    auto oldest = ahead_.find(order_.front());
    order_.pop_front();
    if (oldest == ahead_.end()) continue;
    bytes_ -= oldest->second->n * sizeof(int64_t);
    ahead_.erase(oldest);
  }
  jobs_.push_back({key, std::move(next), draw});
  return absl::OkStatus();
}

void BatchPrefetcher::Run() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &BatchPrefetcher::HasWorkLocked));
      if (stopping_) {
        // Whoever waits on a batch still to draw draws it itself.
        for (Job& j : jobs_) j.batch->dropped = j.batch->ready = true;
        jobs_.clear();
        return;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
      // A batch that made room for others (or was replaced) before its turn is not drawn:
      // memory ahead stays within its bound however fast batches are asked for.
      auto it = ahead_.find(job.key);
      if (it == ahead_.end() || it->second != job.batch) {
        job.batch->dropped = job.batch->ready = true;
        continue;
      }
    }
    job.batch->tokens.resize(job.batch->n);
    const bool drawn = job.draw(job.batch->step, job.batch->tokens.data()).ok();
    if (!drawn) std::vector<int64_t>().swap(job.batch->tokens);  // holds nothing until replaced
    absl::MutexLock lock(&mu_);
    job.batch->dropped = !drawn;  // its caller draws it again, and reports why that failed
    job.batch->ready = true;
  }
}

BatchPrefetcher::Stats BatchPrefetcher::stats() const {
  absl::MutexLock lock(&mu_);
  Stats stats = stats_;
  stats.bytes_ahead = static_cast<int64_t>(bytes_);
  return stats;
}

}  // namespace pathways
