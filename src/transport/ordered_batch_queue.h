// Ordered, batched delivery of items to one receiver, one batch in flight at a time.
#pragma once

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/executor.h"
#include "core/future.h"

namespace pathways {

// Delivers items in the order they are pushed. Push never blocks: items queue up while a batch
// is in flight and go out together in the next one, so the receiver sees them in push order.
// By default a failed batch stops delivery: later pushes are dropped and every Flushed() reports
// the failure. With `on_failed`, a failed batch fails only itself: its items are handed to
// `on_failed`, the Flushed() futures that cover it report the error, and delivery goes on; a
// flush asked for later through an item of a failed batch reports it too (the batch may fail
// between an item's Push and its caller's Flushed), for the last kRememberedFailures batches.
// With a BatchLimit, a batch holds at most `max_bytes` of items by `item_bytes` (and at least one
// item), so that what queues up behind a slow receiver never outgrows the receiver's message
// limit (approximately: the request's own framing is not counted, so leave a margin).
// Thread-safe. Held by shared_ptr: in-flight sends keep it alive.
template <typename Item>
class OrderedBatchQueue : public std::enable_shared_from_this<OrderedBatchQueue<Item>> {
 public:
  // Sends one batch; the future completes when the receiver has accepted it. Called without
  // the queue's lock held; its completion may run on any thread, even this one.
  using SendFn = std::function<Future<Unit>(std::vector<Item>)>;
  using FailedFn = std::function<void(std::vector<Item>, const absl::Status&)>;
  struct BatchLimit {
    std::function<size_t(const Item&)> item_bytes;  // null: no limit
    size_t max_bytes = 0;
  };
  explicit OrderedBatchQueue(SendFn send, FailedFn on_failed = nullptr, BatchLimit limit = {})
      : send_(std::move(send)), on_failed_(std::move(on_failed)), limit_(std::move(limit)) {}

  // Returns the item's number in push order (from 1), for FlushedThrough; 0 once delivery has
  // stopped (the item is dropped). A batch that this push starts is sent on this thread, or with
  // `sender`, from one of its threads: the item keeps its place either way.
  int64_t Push(Item item, Executor* sender = nullptr) {
    Pushed pushed = PushLeavingSend(std::move(item));  // 0 once delivery stopped: Flushed() reports it
    if (pushed.batch) SendStarted(*std::move(pushed.batch), sender);
    return pushed.number;
  }

  // As Push, but a batch this push starts is returned instead of sent: the caller sends it with
  // SendStarted once it holds no lock (the item's place is taken here, under the caller's locks).
  struct Pushed {
    int64_t number = 0;
    std::optional<std::vector<Item>> batch;
  };
  Pushed PushLeavingSend(Item item) {
    Pushed pushed;
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return pushed;
    pending_.push_back(std::move(item));
    pushed.number = ++pushed_;
    if (!in_flight_) pushed.batch = TakeBatchLocked();
    return pushed;
  }
  void SendStarted(std::vector<Item> batch, Executor* sender = nullptr) {
    if (sender != nullptr) {
      sender->Schedule([self = this->shared_from_this(), batch = std::move(batch)]() mutable { self->Send(std::move(batch)); });
    } else {
      Send(std::move(batch));
    }
  }

  // True once a batch failed and stopped delivery (never with on_failed).
  bool failed() {
    absl::MutexLock lock(&mu_);
    return !failure_.ok();
  }
  // Why delivery stopped; OK while it goes on.
  absl::Status failure() {
    absl::MutexLock lock(&mu_);
    return failure_;
  }

  // Completes when every item pushed so far has been accepted, or with the error that stopped
  // delivery.
  Future<Unit> Flushed() {
    absl::MutexLock lock(&mu_);
    return FlushedThroughLocked(pushed_);
  }
  // Completes when items 1..`number` (Push's numbers) have been accepted, whatever was pushed
  // after them, or with the error that stopped delivery.
  Future<Unit> FlushedThrough(int64_t number) {
    absl::MutexLock lock(&mu_);
    return FlushedThroughLocked(std::min(number, pushed_));
  }
  // How many items have been accepted so far.
  int64_t acked() {
    absl::MutexLock lock(&mu_);
    return acked_;
  }

 private:
  Future<Unit> FlushedThroughLocked(int64_t number) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!failure_.ok()) return Future<Unit>::Ready(failure_);
    for (const FailedBatch& f : failed_batches_) {
      if (number >= f.first && number <= f.last) return Future<Unit>::Ready(f.status);
    }
    if (acked_ >= number) return Future<Unit>::Ready(Unit{});
    Promise<Unit> p;
    Future<Unit> f = p.future();
    waiters_.emplace(number, std::move(p));
    return f;
  }

  std::vector<Item> TakeBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Item> batch;
    if (limit_.item_bytes == nullptr) {
      batch = std::move(pending_);
      pending_.clear();
    } else {
      size_t bytes = 0, n = 0;
      for (; n < pending_.size(); ++n) {
        bytes += limit_.item_bytes(pending_[n]);
        if (n > 0 && bytes > limit_.max_bytes) break;
      }
      batch.assign(std::make_move_iterator(pending_.begin()), std::make_move_iterator(pending_.begin() + n));
      pending_.erase(pending_.begin(), pending_.begin() + n);
    }
    in_flight_ = true;
    in_flight_end_ = pushed_ - static_cast<int64_t>(pending_.size());
    if (on_failed_) in_flight_items_ = batch;  // kept to hand back if the batch fails
    return batch;
  }

  void Send(std::vector<Item> batch) {
    send_(std::move(batch)).OnReady([self = this->shared_from_this()](const absl::StatusOr<Unit>& r) {
      self->OnBatchDone(r.status());
    });
  }

  void OnBatchDone(absl::Status status) {
    std::vector<std::pair<Promise<Unit>, absl::Status>> ready;
    std::optional<std::vector<Item>> next;
    std::vector<Item> failed_items;
    {
      absl::MutexLock lock(&mu_);
      in_flight_ = false;
      const int64_t batch_start = acked_;  // the batch held items batch_start+1 .. in_flight_end_
      if (status.ok() || on_failed_) {
        acked_ = in_flight_end_;
      } else {
        failure_ = status;
        pending_.clear();
      }
      if (!status.ok() && on_failed_) {
        failed_items = std::move(in_flight_items_);
        failed_batches_.push_back({batch_start + 1, in_flight_end_, status});
        if (failed_batches_.size() > kRememberedFailures) failed_batches_.pop_front();
      }
      in_flight_items_.clear();
      // Waiters are ordered by number: those through acked_ (all of them once delivery stopped).
      for (auto it = waiters_.begin(); it != waiters_.end() && (!failure_.ok() || it->first <= acked_);) {
        // With on_failed, only waiters whose last item was in the failed batch hear of it.
        const bool failed = !failure_.ok() || (!status.ok() && it->first > batch_start);
        ready.emplace_back(std::move(it->second), failed ? (failure_.ok() ? status : failure_) : absl::OkStatus());
        it = waiters_.erase(it);
      }
      if (failure_.ok() && !pending_.empty()) next = TakeBatchLocked();
    }
    if (!failed_items.empty()) on_failed_(std::move(failed_items), status);
    if (next) Send(*std::move(next));
    for (auto& [p, s] : ready) {
      if (s.ok()) {
        p.Set(Unit{});
      } else {
        p.Set(s);
      }
    }
  }

  // With on_failed: the items of the last failed batches, for flushes asked for after they failed.
  static constexpr size_t kRememberedFailures = 64;
  struct FailedBatch {
    int64_t first, last;
    absl::Status status;
  };
  std::deque<FailedBatch> failed_batches_ ABSL_GUARDED_BY(mu_);
  const SendFn send_;
  const FailedFn on_failed_;
  const BatchLimit limit_;
  absl::Mutex mu_;
  std::vector<Item> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<Item> in_flight_items_ ABSL_GUARDED_BY(mu_);  // only with on_failed_
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t pushed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t in_flight_end_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  // By the item number they wait for: a batch's acknowledgement releases a prefix, whatever
  // order they were asked for in (thousands wait while a fast caller runs ahead).
  std::multimap<int64_t, Promise<Unit>> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
