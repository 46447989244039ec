// A CPU device that behaves like one accelerator core: one in-order execution thread and a
// memory budget of its own.
#pragma once

#include <deque>
#include <memory>
#include <thread>

#include "device/device.h"

namespace pathways {

// Thread-safe. Shutdown (or the destructor) finishes the work already enqueued, then stops the
// stream.
class CpuDevice : public Device {
 public:
  // Kernels running on the stream wait up to `kernel_memory_wait` for their temporaries to fit.
  CpuDevice(int local_index, int64_t memory_capacity_bytes, std::string host_name = "host",
            absl::Duration kernel_memory_wait = absl::ZeroDuration());
  ~CpuDevice() override;

  int local_index() const override { return local_index_; }
  std::string kind() const override { return kind_; }
  std::string name() const override { return name_; }
  void ResetMemoryPeak() override { budget_->ResetPeak(); }
  absl::StatusOr<BufferPtr> Allocate(DType dtype, const Shape& shape,
                                     absl::Duration wait = absl::ZeroDuration()) override;
  void Enqueue(absl::AnyInvocable<void() &&> work) override;
  void RecordTrace(TraceEvent event) override;
  std::vector<TraceEvent> Trace(int64_t since_us = 0) const override;
  static constexpr size_t kTraceCapacity = 1 << 13;  // about 1 MiB of events per device
  DeviceStats stats() const override;
  bool WaitForMemoryUsedAtMost(int64_t bytes, absl::Duration timeout) const override {
    return budget_->WaitForUsedAtMost(bytes, timeout);
  }
  void Shutdown() override;

 protected:
  // For devices that are streams like this one under another kind's name.
  CpuDevice(std::string kind, int local_index, int64_t memory_capacity_bytes, std::string host_name,
            absl::Duration kernel_memory_wait);

 private:
  void StreamLoop();

  const int local_index_;
  const std::string kind_;
  const std::string name_;
  std::shared_ptr<MemoryBudget> budget_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<TraceEvent> trace_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> busy_by_client_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int64_t executed_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t busy_micros_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread stream_;
};

}  // namespace pathways
