#include "compute/batch_prefetcher.h"

#include <cstring>

namespace pathways {

BatchPrefetcher::BatchPrefetcher(size_t max_batches) : max_batches_(max_batches), thread_([this] { Run(); }) {}

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

void BatchPrefetcher::Get(const std::string& key, uint64_t step, size_t n, const Draw& draw, int64_t* out) {
  std::shared_ptr<Batch> ahead;
  {
    absl::MutexLock lock(&mu_);
    auto it = ahead_.find(key);
    if (it != ahead_.end() && it->second->step == step && it->second->tokens.size() == n) {
      ahead = it->second;
      ++stats_.hits;
      // Drawn, or being drawn on the host thread: wait for it rather than drawing twice.
      mu_.Await(absl::Condition(&ahead->ready));
    } else {
      ++stats_.misses;
    }
  }
  if (ahead != nullptr) {
    std::memcpy(out, ahead->tokens.data(), n * sizeof(int64_t));
  } else {
    draw(step, out);
  }
  // Step + 1, for the host thread.
  auto next = std::make_shared<Batch>();
  next->step = step + 1;
  next->tokens.resize(n);
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  auto [it, is_new] = ahead_.insert_or_assign(key, next);
  if (is_new) {
    order_.push_back(key);
    while (ahead_.size() > max_batches_ && !order_.empty()) {  // keys not used for longest go
      ahead_.erase(order_.front());
      order_.pop_front();
    }
  }
  jobs_.push_back({key, std::move(next), draw});
}

void BatchPrefetcher::Run() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &BatchPrefetcher::HasWorkLocked));
      if (stopping_) {
        // Whoever waits on a batch still to draw gets it drawn now (never a batch left unready).
        for (Job& j : jobs_) {
          j.draw(j.batch->step, j.batch->tokens.data());
          j.batch->ready = true;
        }
        jobs_.clear();
        return;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.draw(job.batch->step, job.batch->tokens.data());
    absl::MutexLock lock(&mu_);
    job.batch->ready = true;
  }
}

BatchPrefetcher::Stats BatchPrefetcher::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace pathways
