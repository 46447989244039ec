// Asking the computation on a device's thread to stop early: how a worker ends a tenant's body
// that runs past its computation timeout without taking the host out of the cluster. A device
// cannot be preempted, so the body polls at the points where it can run long: each turn of a
// TorchScript loop (compute/op_guards.h puts a `pathways::stop_point` there) and each pass of
// `pathways.fma_loop`. A kernel that does not poll (one aten call, a simulated device's modelled
// duration) runs to its end. Torch-free.
#pragma once

#include <atomic>

namespace pathways {

// Makes `flag` the current thread's stop request for the scope's lifetime; nullptr: none. The
// flag outlives the scope and may be set from any thread.
class ScopedStopRequest {
 public:
  explicit ScopedStopRequest(const std::atomic<bool>* flag);
  ~ScopedStopRequest();
  ScopedStopRequest(const ScopedStopRequest&) = delete;
  ScopedStopRequest& operator=(const ScopedStopRequest&) = delete;

 private:
  const std::atomic<bool>* previous_;
};

// Whether the computation on this thread was asked to stop.
bool StopRequested();

}  // namespace pathways
