// Ordered, batched delivery of items to one receiver, one batch in flight at a time.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"

namespace pathways {

// Delivers items in the order they are pushed. Push never blocks: items queue up while a batch
// is in flight and go out together in the next one, so the receiver sees them in push order.
// A failed batch stops delivery: later pushes are dropped and every Flushed() reports the
// failure. Thread-safe. Held by shared_ptr: in-flight sends keep it alive.
template <typename Item>
class OrderedBatchQueue : public std::enable_shared_from_this<OrderedBatchQueue<Item>> {
 public:
  // Sends one batch; the future completes when the receiver has accepted it. Called without
  // the queue's lock held; its completion may run on any thread, even this one.
  using SendFn = std::function<Future<Unit>(std::vector<Item>)>;
  explicit OrderedBatchQueue(SendFn send) : send_(std::move(send)) {}

  void Push(Item item) {
    std::optional<std::vector<Item>> batch;
    {
      absl::MutexLock lock(&mu_);
      if (!failure_.ok()) return;  // Flushed() reports the failure
      pending_.push_back(std::move(item));
      ++pushed_;
      if (!in_flight_) batch = TakeBatchLocked();
    }
    if (batch) Send(*std::move(batch));
  }

  // Completes when every item pushed so far has been accepted, or with the error that stopped
  // delivery.
  Future<Unit> Flushed() {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return Future<Unit>::Ready(failure_);
    if (acked_ == pushed_) return Future<Unit>::Ready(Unit{});
    Promise<Unit> p;
    Future<Unit> f = p.future();
    waiters_.emplace_back(pushed_, std::move(p));
    return f;
  }

 private:
  std::vector<Item> TakeBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Item> batch = std::move(pending_);
    pending_.clear();
    in_flight_ = true;
    in_flight_end_ = pushed_;
    return batch;
  }

  void Send(std::vector<Item> batch) {
    send_(std::move(batch)).OnReady([self = this->shared_from_this()](const absl::StatusOr<Unit>& r) {
      self->OnBatchDone(r.status());
    });
  }

  void OnBatchDone(absl::Status status) {
    std::vector<Promise<Unit>> ready;
    std::optional<std::vector<Item>> next;
    absl::Status failure;
    {
      absl::MutexLock lock(&mu_);
      in_flight_ = false;
      if (!status.ok()) {
        failure_ = status;
        pending_.clear();
      } else {
        acked_ = in_flight_end_;
      }
      failure = failure_;
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (!failure_.ok() || it->first <= acked_) {
          ready.push_back(std::move(it->second));
          it = waiters_.erase(it);
        } else {
          ++it;
        }
      }
      if (failure_.ok() && !pending_.empty()) next = TakeBatchLocked();
    }
    if (next) Send(*std::move(next));
    for (auto& p : ready) {
      if (failure.ok()) {
        p.Set(Unit{});
      } else {
        p.Set(failure);
      }
    }
  }

  const SendFn send_;
  absl::Mutex mu_;
  std::vector<Item> pending_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pushed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_flight_end_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, Promise<Unit>>> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
