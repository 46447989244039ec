// Future<T> / Promise<T>: the one way asynchronous results travel through the runtime.
//
// A Promise is move-only and is fulfilled once, with a value or an error Status. A Future is a
// cheap copyable handle to the same result. Both are thread-safe. Callbacks registered with
// OnReady run exactly once: inline on the thread that fulfils the promise, or inline in OnReady
// when the result is already there. Callbacks that do real work should hop to an Executor
// (OnReady(executor, cb)) instead of running on an RPC or device thread.
//
// A Promise destroyed without being fulfilled fails its future with Cancelled, so a dropped
// producer can never leave a consumer waiting forever.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/executor.h"

namespace pathways {

// The value of a future that only signals completion.
struct Unit {};

template <typename T>
class Future;

namespace internal {

template <typename T>
class FutureState {
 public:
  using Callback = absl::AnyInvocable<void(const absl::StatusOr<T>&) &&>;

  void Set(absl::StatusOr<T> result) {
    std::vector<Callback> callbacks;
    {
      absl::MutexLock lock(&mu_);
      if (result_.has_value()) return;  // first result wins
      result_.emplace(std::move(result));
      callbacks.swap(callbacks_);
    }
    for (auto& cb : callbacks) std::move(cb)(SetResult());
  }

  void AddCallback(Callback cb) {
    {
      absl::MutexLock lock(&mu_);
      if (!result_.has_value()) {
        callbacks_.push_back(std::move(cb));
        return;
      }
    }
    std::move(cb)(SetResult());
  }

  bool IsReady() {
    absl::MutexLock lock(&mu_);
    return result_.has_value();
  }

  const absl::StatusOr<T>& Await() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::optional<absl::StatusOr<T>>* r) { return r->has_value(); }, &result_));
    return *result_;
  }

  // Returns nullptr when the deadline passes first.
  const absl::StatusOr<T>* AwaitWithTimeout(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(
            absl::Condition(
                +[](std::optional<absl::StatusOr<T>>* r) { return r->has_value(); }, &result_),
            timeout)) {
      return nullptr;
    }
    return &*result_;
  }

 private:
  absl::Mutex mu_;
  // The result, once Set has set it: it never changes after that, so it is read without the lock
  // (the analysis cannot know that a value written once under the lock is stable).
  const absl::StatusOr<T>& SetResult() ABSL_NO_THREAD_SAFETY_ANALYSIS { return *result_; }
  std::optional<absl::StatusOr<T>> result_ ABSL_GUARDED_BY(mu_);
  std::vector<Callback> callbacks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

template <typename T>
class Promise {
 public:
  Promise() : state_(std::make_shared<internal::FutureState<T>>()) {}
  Promise(Promise&&) = default;
  Promise& operator=(Promise&& other) {
    Abandon();
    state_ = std::move(other.state_);
    return *this;
  }
  Promise(const Promise&) = delete;
  Promise& operator=(const Promise&) = delete;
  ~Promise() { Abandon(); }

  Future<T> future() const;
  // Fulfils the future. Later calls do nothing: the first result stands.
  void Set(absl::StatusOr<T> result) {
    if (!state_) return;
    state_->Set(std::move(result));
    state_.reset();
  }
  bool valid() const { return state_ != nullptr; }

 private:
  void Abandon() {
    if (state_) state_->Set(absl::CancelledError("promise dropped before it was fulfilled"));
  }
  std::shared_ptr<internal::FutureState<T>> state_;
};

template <typename T>
class [[nodiscard]] Future {
 public:
  using ValueType = T;
  using Callback = typename internal::FutureState<T>::Callback;

  Future() = default;  // an invalid future; only assign to it
  bool valid() const { return state_ != nullptr; }
  bool IsReady() const { return state_->IsReady(); }

  // Blocks until the result is there. The reference lives as long as any copy of this future.
  const absl::StatusOr<T>& Await() const { return state_->Await(); }
  // Blocks up to `timeout`; DeadlineExceeded if the result is not there by then.
  absl::StatusOr<T> AwaitFor(absl::Duration timeout) const {
    const absl::StatusOr<T>* r = state_->AwaitWithTimeout(timeout);
    if (r == nullptr) return absl::DeadlineExceededError("timed out waiting for a future");
    return *r;
  }
  // Blocks up to `timeout`; whether the result is there (without copying it).
  bool WaitFor(absl::Duration timeout) const { return state_->AwaitWithTimeout(timeout) != nullptr; }
  // Blocks until the result is there and returns it, moved out when this future is the only one
  // left that can see it (its promise is set and no other copy exists), copied otherwise: for
  // large values (a fetched array) whose last reader is known.
  // This future is invalid afterwards.
  absl::StatusOr<T> Take() && {
    std::shared_ptr<internal::FutureState<T>> state = std::move(state_);
    const absl::StatusOr<T>& r = state->Await();
    if (state.use_count() == 1) {
      // The count is read relaxed: order the other holders' last reads before the move.
      std::atomic_thread_fence(std::memory_order_acquire);
      return std::move(const_cast<absl::StatusOr<T>&>(r));
    }
    return r;
  }

  void OnReady(Callback cb) const { state_->AddCallback(std::move(cb)); }
  // Runs `cb` on `executor` once the result is there.
  void OnReady(Executor& executor, Callback cb) const {
    auto state = state_;
    state_->AddCallback([&executor, state, cb = std::move(cb)](const absl::StatusOr<T>&) mutable {
      executor.Schedule([state, cb = std::move(cb)]() mutable { std::move(cb)(state->Await()); });
    });
  }

  // Returns a future of f(value); errors pass through without calling f.
  // f returns either U or absl::StatusOr<U>. What f captures is released before the result is
  // set, so whoever waits for the result finds it released (a handle captured there is gone).
  template <typename F, typename R = std::invoke_result_t<F, const T&>>
  auto Then(F f) const {
    using U = typename UnwrapStatusOr<R>::type;
    Promise<U> promise;
    Future<U> result = promise.future();
    OnReady([promise = std::move(promise), f = std::optional<F>(std::move(f))](const absl::StatusOr<T>& r) mutable {
      if (!r.ok()) {
        f.reset();
        promise.Set(r.status());
        return;
      }
      absl::StatusOr<U> value = (*f)(*r);
      f.reset();
      promise.Set(std::move(value));
    });
    return result;
  }

  // Returns a future of the future that f(value) returns: for chaining asynchronous steps.
  // Errors pass through without calling f.
  template <typename F, typename R = std::invoke_result_t<F, const T&>>
  R FlatThen(F f) const {
    using U = typename R::ValueType;
    Promise<U> promise;
    R result = promise.future();
    OnReady([promise = std::move(promise), f = std::optional<F>(std::move(f))](const absl::StatusOr<T>& r) mutable {
      if (!r.ok()) {
        f.reset();
        promise.Set(r.status());
        return;
      }
      R next = (*f)(*r);
      f.reset();  // as in Then
      next.OnReady([promise = std::move(promise)](const absl::StatusOr<U>& u) mutable { promise.Set(u); });
    });
    return result;
  }

  static Future<T> Ready(absl::StatusOr<T> value) {
    Promise<T> p;
    Future<T> f = p.future();
    p.Set(std::move(value));
    return f;
  }

 private:
  template <typename R>
  struct UnwrapStatusOr {
    using type = R;
  };
  template <typename R>
  struct UnwrapStatusOr<absl::StatusOr<R>> {
    using type = R;
  };

  friend class Promise<T>;
  explicit Future(std::shared_ptr<internal::FutureState<T>> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::FutureState<T>> state_;
};

template <typename T>
Future<T> Promise<T>::future() const {
  return Future<T>(state_);
}

// Completes with all values, in order, once every input is ready; or with the first error as
// soon as any input fails.
template <typename T>
Future<std::vector<T>> JoinAll(const std::vector<Future<T>>& futures) {
  struct Join {
    absl::Mutex mu;
    std::vector<std::optional<T>> values ABSL_GUARDED_BY(mu);
    size_t remaining ABSL_GUARDED_BY(mu);
    Promise<std::vector<T>> promise ABSL_GUARDED_BY(mu);
  };
  if (futures.empty()) return Future<std::vector<T>>::Ready(std::vector<T>{});
  auto join = std::make_shared<Join>();
  Future<std::vector<T>> result;
  {
    absl::MutexLock lock(&join->mu);
    join->values.resize(futures.size());
    join->remaining = futures.size();
    result = join->promise.future();
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    futures[i].OnReady([join, i](const absl::StatusOr<T>& r) {
      Promise<std::vector<T>> to_set;
      absl::StatusOr<std::vector<T>> value;
      {
        absl::MutexLock lock(&join->mu);
        if (!join->promise.valid()) return;  // already failed
        if (!r.ok()) {
          value = r.status();
        } else {
          join->values[i] = *r;
          if (--join->remaining > 0) return;
          std::vector<T> all;
          all.reserve(join->values.size());
          for (auto& v : join->values) all.push_back(std::move(*v));
          value = std::move(all);
        }
        to_set = std::move(join->promise);
      }
      to_set.Set(std::move(value));
    });
  }
  return result;
}

// Completes once every input has, or with the first error: JoinAll for futures that carry no
// value. A single input is passed through as it is.
inline Future<Unit> AllDone(const std::vector<Future<Unit>>& futures) {
  if (futures.size() == 1) return futures.front();
  return JoinAll(futures).Then([](const std::vector<Unit>&) { return Unit{}; });
}

}  // namespace pathways
