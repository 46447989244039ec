#include "core/executor.h"

#include <pthread.h>

namespace pathways {

ThreadPool::ThreadPool(std::string name, int num_threads) : name_(std::move(name)) {
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, i] {
      std::string thread_name = name_.substr(0, 12) + "-" + std::to_string(i);
      pthread_setname_np(pthread_self(), thread_name.c_str());
      WorkLoop();
    });
  }
}

ThreadPool::~ThreadPool() { Shutdown(); }

void ThreadPool::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
  std::deque<absl::AnyInvocable<void() &&>> dropped;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    dropped.swap(queue_);
  }
  // Destroyed outside the lock: dropping a task may cancel futures whose continuations schedule
  // more work here.
}

void ThreadPool::Schedule(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  queue_.push_back(std::move(task));
}

void ThreadPool::WorkLoop() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stopping_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace pathways
