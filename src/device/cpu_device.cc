#include "device/cpu_device.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/executor.h"
#include "device/host_memory.h"

namespace pathways {

absl::Status MemoryBudget::Charge(int64_t bytes, absl::Duration wait) {
  if (bytes > capacity_) {  // would never fit: no waiting for it
    return absl::ResourceExhaustedError(absl::StrCat("device ", device_name_, ": cannot allocate ", bytes,
                                                     " bytes, more than its whole memory (", capacity_, " bytes)"));
  }
  // Errors are written once the lock is released: their strings are allocated, and a body's heap
  // may charge what it allocates to this same budget (compute/body_heap.h).
  int64_t used = 0;
  {
    absl::MutexLock lock(&mu_);
    auto fits = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return bytes <= capacity_ - used_; };
    if (fits() || (wait > absl::ZeroDuration() && mu_.AwaitWithTimeout(absl::Condition(&fits), wait))) {
      used_ += bytes;
      peak_ = std::max(peak_, used_);
      return absl::OkStatus();
    }
    used = used_;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "device ", device_name_, ": cannot allocate ", bytes, " bytes; ", used, " of ", capacity_, " bytes in use, ",
      capacity_ - used, " free",
      wait > absl::ZeroDuration()
          ? absl::StrCat(" after waiting ", absl::FormatDuration(wait), " for other buffers to be released")
          : ""));
}

int64_t MemoryBudget::peak() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

void MemoryBudget::ResetPeak() {
  absl::MutexLock lock(&mu_);
  peak_ = used_;
}

namespace {
thread_local const std::shared_ptr<MemoryBudget>* current_budget = nullptr;
}  // namespace

const std::shared_ptr<MemoryBudget>* MemoryBudget::Current() { return current_budget; }

MemoryBudget::ScopedCurrent::ScopedCurrent(std::shared_ptr<MemoryBudget> budget)
    : budget_(std::move(budget)), previous_(current_budget) {
  current_budget = &budget_;
}

MemoryBudget::ScopedCurrent::~ScopedCurrent() { current_budget = previous_; }

void MemoryBudget::Release(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
}

int64_t MemoryBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

bool MemoryBudget::WaitForUsedAtMost(int64_t bytes, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto low_enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return used_ <= bytes; };
  return mu_.AwaitWithTimeout(absl::Condition(&low_enough), timeout);
}

DeviceBuffer::DeviceBuffer(std::shared_ptr<MemoryBudget> budget, int device_index, DType dtype,
                           Shape shape, int64_t byte_size)
    : budget_(std::move(budget)),
      device_index_(device_index),
      dtype_(dtype),
      shape_(std::move(shape)),
      byte_size_(byte_size) {
  // 64-byte aligned, as kernels expect; never null. Large buffers reuse cached pages.
  data_ = HostMemory::Allocate(static_cast<size_t>(byte_size_));
  if (data_ == nullptr) throw std::bad_alloc();
}

DeviceBuffer::~DeviceBuffer() {
  HostMemory::Free(data_);
  budget_->Release(byte_size_);
}

CpuDevice::CpuDevice(int local_index, int64_t memory_capacity_bytes, std::string host_name,
                     absl::Duration kernel_memory_wait)
    : CpuDevice("cpu", local_index, memory_capacity_bytes, std::move(host_name), kernel_memory_wait) {}

CpuDevice::CpuDevice(std::string kind, int local_index, int64_t memory_capacity_bytes, std::string host_name,
                     absl::Duration kernel_memory_wait)
    : local_index_(local_index),
      kind_(std::move(kind)),
      name_(absl::StrCat(host_name, "/", kind_, ":", local_index)),
      budget_(std::make_shared<MemoryBudget>(name_, memory_capacity_bytes, kernel_memory_wait)) {
  stream_ = std::thread([this] {
    NameThisThread(absl::StrCat(kind_, "-dev-", local_index_));
    StreamLoop();
  });
}

CpuDevice::~CpuDevice() { Shutdown(); }

void CpuDevice::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  stream_.join();
  std::deque<absl::AnyInvocable<void() &&>> dropped;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    dropped.swap(queue_);
  }
  // Destroyed outside the lock: dropping a task may cancel futures whose continuations schedule
  // more work here.
}

absl::StatusOr<BufferPtr> CpuDevice::Allocate(DType dtype, const Shape& shape, absl::Duration wait) {
  auto size = ByteSize(dtype, shape);
  if (!size.ok()) return size.status();
  if (*size > budget_->capacity()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device ", name_, ": buffer ", DTypeName(dtype), ShapeToString(shape), " of ",
                     *size, " bytes exceeds the device's whole budget of ", budget_->capacity(),
                     " bytes"));
  }
  auto charged = budget_->Charge(*size, wait);
  if (!charged.ok()) return charged;
  return std::make_shared<DeviceBuffer>(budget_, local_index_, dtype, shape, *size);
}

void CpuDevice::Enqueue(absl::AnyInvocable<void() &&> work) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  queue_.push_back(std::move(work));
}

void CpuDevice::RecordTrace(TraceEvent event) {
  absl::MutexLock lock(&mu_);
  busy_by_client_[event.label.client] += event.end_us - event.start_us;
  busy_micros_ += event.end_us - event.start_us;
  ++executed_;
  trace_.push_back(std::move(event));
  if (trace_.size() > kTraceCapacity) trace_.pop_front();
}

std::vector<TraceEvent> CpuDevice::Trace(int64_t since_us) const {
  absl::MutexLock lock(&mu_);
  std::vector<TraceEvent> events;
  for (const TraceEvent& e : trace_) {
    if (e.end_us >= since_us) events.push_back(e);
  }
  return events;
}

DeviceStats CpuDevice::stats() const {
  DeviceStats s;
  s.memory_capacity = budget_->capacity();
  s.memory_used = budget_->used();
  s.memory_peak = budget_->peak();
  absl::MutexLock lock(&mu_);
  s.executed = executed_;
  s.busy_micros = busy_micros_;
  s.busy_micros_by_client = busy_by_client_;
  return s;
}

void CpuDevice::StreamLoop() {
  MemoryBudget::ScopedCurrent kernels_charge_here(budget_);
  while (true) {
    absl::AnyInvocable<void() &&> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CpuDevice* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
            return d->stopping_ || !d->queue_.empty();
          },
          this));
      if (queue_.empty()) return;
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(work)();
  }
}

}  // namespace pathways
