// Executors run closures on threads they own.
#pragma once

#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace pathways {

// Something that runs closures later, on a thread of its own. Implementations are thread-safe.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual void Schedule(absl::AnyInvocable<void() &&> task) = 0;
};

// A fixed pool of named threads draining one FIFO queue. Thread-safe. Shutdown (or the
// destructor) runs every task already scheduled, then joins the threads; tasks scheduled after
// that are dropped.
class ThreadPool : public Executor {
 public:
  ThreadPool(std::string name, int num_threads);
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(absl::AnyInvocable<void() &&> task) override;
  void Shutdown();

 private:
  void WorkLoop();

  const std::string name_;
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace pathways
