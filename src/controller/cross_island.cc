#include "controller/cross_island.h"

namespace pathways {

void CrossIslandOrder::Ready(std::vector<std::function<void()>> sends) {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    ready_.push_back(std::move(sends));
    if (draining_) return;  // the thread sending now sends this one after its own
    draining_ = true;
  }
  while (true) {
    std::vector<std::function<void()>> next;
    {
      absl::MutexLock lock(&mu_);
      if (ready_.empty() || closed_) {
        ready_.clear();
        draining_ = false;
        return;
      }
      next = std::move(ready_.front());
      ready_.pop_front();
    }
    for (auto& send : next) send();
  }
}

void CrossIslandOrder::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  mu_.Await(absl::Condition(
      +[](bool* draining) { return !*draining; }, &draining_));
}

void CrossIslandRun::Reached(std::function<void()> send, std::function<void(absl::Status)> cancel) {
  std::vector<std::function<void()>> sends;
  absl::Status cancelled;
  {
    absl::MutexLock lock(&mu_);
    cancelled = cancelled_;
    if (cancelled.ok()) {
      sends_.push_back(std::move(send));
      cancels_.push_back(std::move(cancel));
      if (--left_ == 0) {
        sends = std::move(sends_);
        cancels_.clear();
      }
    }
  }
  if (!cancelled.ok()) {
    cancel(cancelled);
  } else if (!sends.empty()) {
    order_.Ready(std::move(sends));
  }
}

void CrossIslandRun::Cancel(const absl::Status& why) {
  std::vector<std::function<void(absl::Status)>> cancels;
  {
    absl::MutexLock lock(&mu_);
    if (!cancelled_.ok() || left_ == 0) return;  // already dropped, or already on its way
    cancelled_ = why;
    cancels = std::move(cancels_);
    sends_.clear();
  }
  for (auto& cancel : cancels) cancel(why);
}

}  // namespace pathways
