// Executors run closures on threads they own.
#pragma once

#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace pathways {

// Names the calling thread as `perf`, `top -H` and /proc show it (the first 15 bytes). A thread
// started without a name takes its creator's, which misleads a profile.
void NameThisThread(const std::string& name);

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

// A pool that keeps a thread free for the next task: a thread that takes a task and leaves none
// free starts another, up to `max_threads`; threads stay until Shutdown. For tasks that may block
// on one another (the continuations of RPC completions, which may wait for other calls): a task
// that blocks holds back the queue only once `max_threads` block. Threads are started by the
// constructor and by the pool's own threads, never by Schedule's caller (which may be a thread of
// a library's, gRPC's completion threads say). Thread-safe. Shutdown (or the destructor) runs
// every task already scheduled, then joins the threads; tasks scheduled after that are dropped.
class GrowingThreadPool : public Executor {
 public:
  GrowingThreadPool(std::string name, int max_threads);
  ~GrowingThreadPool() override;
  GrowingThreadPool(const GrowingThreadPool&) = delete;
  GrowingThreadPool& operator=(const GrowingThreadPool&) = delete;

  void Schedule(absl::AnyInvocable<void() &&> task) override;
  void Shutdown();
  int threads_started();

 private:
  // Under mu_: callers of Schedule wait for a thread's creation, which is rare (the pool only
  // grows while tasks block).
  void StartThreadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkLoop();

  const std::string name_;
  const int max_threads_;
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  int free_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a task, or starting
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);  // moved out to be joined once stopping_
};

}  // namespace pathways
