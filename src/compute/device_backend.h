// The kinds of device a host can have, and how bodies are compiled for each: the one place that
// knows them, so the host runtime, the worker and everything above them treat every kind alike.
// A CUDA device would be a third kind here, with its own device class and compiler.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "compute/executable.h"
#include "compute/modelled_executable.h"
#include "device/device.h"

namespace pathways {

// Immutable; copies share the cost model. Default-constructed: CPU devices.
class DeviceBackend {
 public:
  // "cpu": libtorch kernels on CpuDevice streams. "sim": SimulatedDevice streams whose kernels
  // take the durations `cost_text` gives (ParseCostModel's form; compute/modelled_executable.h).
  // InvalidArgument naming the kinds there are, or the bad cost entry; costs given for "cpu" are
  // an error too. TorchScript bodies may call the ops `ops` allows (compute/function_ops.h;
  // simulated devices run no body's ops).
  static absl::StatusOr<DeviceBackend> Create(const std::string& kind, const std::string& cost_text = "",
                                              FunctionOps ops = FunctionOps::kVetted);
  DeviceBackend() = default;

  const char* kind() const { return costs_ == nullptr ? "cpu" : "sim"; }
  std::unique_ptr<Device> MakeDevice(int local_index, int64_t memory_bytes, const std::string& host_name,
                                     absl::Duration kernel_memory_wait) const;
  Compiler compiler() const;

 private:
  DeviceBackend(std::shared_ptr<const CostModel> costs, FunctionOps ops) : costs_(std::move(costs)), ops_(ops) {}
  std::shared_ptr<const CostModel> costs_;  // set for simulated devices only
  FunctionOps ops_ = FunctionOps::kVetted;
};

}  // namespace pathways
