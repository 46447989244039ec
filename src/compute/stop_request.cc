#include "compute/stop_request.h"

namespace pathways {
namespace {
thread_local const std::atomic<bool>* current_stop = nullptr;
}  // namespace

ScopedStopRequest::ScopedStopRequest(const std::atomic<bool>* flag) : previous_(current_stop) { current_stop = flag; }
ScopedStopRequest::~ScopedStopRequest() { current_stop = previous_; }

bool StopRequested() {
  const std::atomic<bool>* flag = current_stop;
  return flag != nullptr && flag->load(std::memory_order_relaxed);
}

}  // namespace pathways
