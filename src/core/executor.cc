#include "core/executor.h"

#include <pthread.h>

#include <algorithm>

namespace pathways {

void NameThisThread(const std::string& name) { pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

ThreadPool::ThreadPool(std::string name, int num_threads) : name_(std::move(name)) {
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, i] {
      NameThisThread(name_.substr(0, 12) + "-" + std::to_string(i));
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

GrowingThreadPool::GrowingThreadPool(std::string name, int max_threads)
    : name_(std::move(name)), max_threads_(std::max(1, max_threads)) {
  absl::MutexLock lock(&mu_);
  StartThreadLocked();
}

void GrowingThreadPool::StartThreadLocked() {
  ++free_;  // from now: a thread still starting takes the next task as soon as it can
  const int index = started_++;
  threads_.emplace_back([this, index] {
    NameThisThread(name_.substr(0, 12) + "-" + std::to_string(index));
    WorkLoop();
  });
}

GrowingThreadPool::~GrowingThreadPool() { Shutdown(); }

void GrowingThreadPool::Shutdown() {
  std::vector<std::thread> joining;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    joining.swap(threads_);  // no thread starts from now on
  }
  for (auto& t : joining) t.join();
  std::deque<absl::AnyInvocable<void() &&>> dropped;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    dropped.swap(queue_);  // scheduled while the last threads ended: dropped outside the lock
  }
}

void GrowingThreadPool::Schedule(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  queue_.push_back(std::move(task));
}

int GrowingThreadPool::threads_started() {
  absl::MutexLock lock(&mu_);
  return started_;
}

void GrowingThreadPool::WorkLoop() {
  mu_.Lock();
  while (true) {  // counted in free_ here: since StartThreadLocked, or since its last task
    mu_.Await(absl::Condition(
        +[](GrowingThreadPool* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return self->stopping_ || !self->queue_.empty();
        },
        this));
    if (queue_.empty()) break;  // stopping and drained
    absl::AnyInvocable<void() &&> task = std::move(queue_.front());
    queue_.pop_front();
    --free_;
    if (free_ == 0 && started_ < max_threads_ && !stopping_) StartThreadLocked();  // one free for the next
    mu_.Unlock();
    std::move(task)();
    task = nullptr;  // what it held goes before the lock is taken again
    mu_.Lock();
    ++free_;
  }
  --free_;
  mu_.Unlock();
}

}  // namespace pathways
