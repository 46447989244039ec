// A device for runs at a scale this machine has no cores for: an in-order stream with its own
// memory budget, exactly as CpuDevice, whose kernels are modelled rather than computed (see
// compute/modelled_executable.h). Everything around a kernel stays real: buffers are allocated and
// charged, work waits for its inputs in stream order, gangs meet for their collectives.
#pragma once

#include "device/cpu_device.h"

namespace pathways {

// Thread-safe, as CpuDevice.
class SimulatedDevice final : public CpuDevice {
 public:
  SimulatedDevice(int local_index, int64_t memory_capacity_bytes, std::string host_name = "host",
                  absl::Duration kernel_memory_wait = absl::ZeroDuration())
      : CpuDevice("sim", local_index, memory_capacity_bytes, std::move(host_name), kernel_memory_wait) {}
};

}  // namespace pathways
