// Devices: the execution units that compiled functions run on, each with its own memory budget.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/types.h"

namespace pathways {

// Bytes charged against one device. Thread-safe. Shared by the device and its live buffers, so a
// buffer that outlives its device still releases its charge safely.
class MemoryBudget {
 public:
  // Kernels wait up to `kernel_wait` for their temporaries to fit (see Current).
  MemoryBudget(std::string device_name, int64_t capacity_bytes, absl::Duration kernel_wait = absl::ZeroDuration())
      : device_name_(std::move(device_name)), capacity_(capacity_bytes), kernel_wait_(kernel_wait) {}
  // Charges `bytes`, waiting up to `wait` for other buffers to be released when they do not fit
  // now. ResourceExhausted, naming the device and the sizes, when they still do not.
  absl::Status Charge(int64_t bytes, absl::Duration wait = absl::ZeroDuration());
  void Release(int64_t bytes);
  int64_t capacity() const { return capacity_; }
  absl::Duration kernel_wait() const { return kernel_wait_; }
  int64_t used() const;
  // Blocks until at most `bytes` are in use; false if that has not happened within `timeout`.
  bool WaitForUsedAtMost(int64_t bytes, absl::Duration timeout) const;
  // The most bytes in use at once since the budget was made or its peak was last reset.
  int64_t peak() const;
  void ResetPeak();

  // The budget of the device whose stream runs on this thread (null elsewhere): kernels charge
  // their temporaries to it, as an accelerator's kernels take theirs from its memory.
  static const std::shared_ptr<MemoryBudget>* Current();
  // Makes `budget` the current thread's for the scope's lifetime.
  class ScopedCurrent {
   public:
    explicit ScopedCurrent(std::shared_ptr<MemoryBudget> budget);
    ~ScopedCurrent();
    ScopedCurrent(const ScopedCurrent&) = delete;
    ScopedCurrent& operator=(const ScopedCurrent&) = delete;

   private:
    std::shared_ptr<MemoryBudget> budget_;
    const std::shared_ptr<MemoryBudget>* previous_;
  };

 private:
  const std::string device_name_;
  const int64_t capacity_;
  const absl::Duration kernel_wait_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

// What a body keeps on a device with one of its output buffers besides the bytes (the autograd
// graph of a forward pass that keeps its residuals), released with the buffer.
class BufferAttachment {
 public:
  virtual ~BufferAttachment() = default;
};

// A dense row-major array in one device's memory. Owns its storage and its charge against the
// device's budget, which it releases when destroyed. The contents are written once, by whoever
// allocated it, before the buffer is shared; after that it is read-only and thread-safe. Buffers
// are always owned by BufferPtrs, so a kernel that keeps a view of one can keep it alive.
class DeviceBuffer : public std::enable_shared_from_this<DeviceBuffer> {
 public:
  DeviceBuffer(std::shared_ptr<MemoryBudget> budget, int device_index, DType dtype, Shape shape,
               int64_t byte_size);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  int device_index() const { return device_index_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t byte_size() const { return byte_size_; }
  char* data() { return data_; }
  const char* data() const { return data_; }
  // Set, like the contents, by the body that writes the buffer, before it is shared. Never
  // copied: a copy of the buffer (a transfer, an assembled input) has none.
  void set_attachment(std::shared_ptr<const BufferAttachment> attachment) { attachment_ = std::move(attachment); }
  const std::shared_ptr<const BufferAttachment>& attachment() const { return attachment_; }

 private:
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<const BufferAttachment> attachment_;
  const int device_index_;
  const DType dtype_;
  const Shape shape_;
  const int64_t byte_size_;
  char* data_;
};

using BufferPtr = std::shared_ptr<DeviceBuffer>;

// What a work item is, for traces: whose, which program run and node, which shard.
struct WorkLabel {
  std::string client;
  int64_t program = 0;
  int64_t run = 0;
  int32_t node = -1;
  int64_t shard = -1;
  std::string name;  // the function's name
};

// One work item a device ran, with wall-clock microseconds since the Unix epoch.
struct TraceEvent {
  WorkLabel label;
  int64_t start_us = 0;
  int64_t end_us = 0;
};

struct DeviceStats {
  int64_t memory_capacity = 0;
  int64_t memory_used = 0;
  int64_t memory_peak = 0;  // since the device started or its peak was last reset
  int64_t executed = 0;     // computations run (each traced, and counted before its results show)
  int64_t busy_micros = 0;  // traced time computing (not time an item spent waiting for inputs)
  // Traced device time per client: what multi-tenant shares are measured in.
  std::map<std::string, int64_t> busy_micros_by_client;
};

// One physical device. Work runs on one in-order stream: items run one at a time, in the order
// they were enqueued, each to completion (non-preemptible). Like an accelerator's stream, an item
// at the head waits there for its inputs; the order is decided when work is enqueued, which is
// what lets an island's scheduler give every device the same order. Thread-safe.
class Device {
 public:
  virtual ~Device() = default;
  virtual int local_index() const = 0;
  virtual std::string kind() const = 0;
  virtual std::string name() const = 0;
  // Allocates and charges a buffer. One larger than the device's whole budget fails at once with
  // ResourceExhausted; one that does not fit now waits up to `wait` for memory to be released
  // (backpressure), then fails with ResourceExhausted naming the device and the sizes.
  virtual absl::StatusOr<BufferPtr> Allocate(DType dtype, const Shape& shape,
                                             absl::Duration wait = absl::ZeroDuration()) = 0;
  // Work enqueued after Shutdown is dropped, never run.
  virtual void Enqueue(absl::AnyInvocable<void() &&> work) = 0;
  // Adds what a work item ran to the device's trace and counts it as executed. Called by the work
  // item itself, before it makes its results visible, so anyone who sees a result can also see
  // its trace event and its count.
  virtual void RecordTrace(TraceEvent event) = 0;
  // The recorded events that ended at or after `since_us`, oldest first. Devices keep the most
  // recent ones only (a bounded ring).
  virtual std::vector<TraceEvent> Trace(int64_t since_us = 0) const = 0;
  virtual DeviceStats stats() const = 0;
  // Starts stats().memory_peak again from what is in use now (benchmarks measuring one phase).
  virtual void ResetMemoryPeak() = 0;
  // Blocks until at most `bytes` of the device's memory are in use, or `timeout` passes (false).
  // Buffers are freed asynchronously (when the last work item or transfer using them is done),
  // so this is how a caller waits for memory to come back without polling.
  virtual bool WaitForMemoryUsedAtMost(int64_t bytes, absl::Duration timeout) const = 0;
  // Finishes the work already enqueued and stops the stream. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace pathways
