#include "compute/device_backend.h"

#include "absl/strings/str_cat.h"
#include "device/cpu_device.h"
#include "device/simulated_device.h"

namespace pathways {

absl::StatusOr<DeviceBackend> DeviceBackend::Create(const std::string& kind, const std::string& cost_text,
                                                    FunctionOps ops) {
  if (kind == "cpu") {
    if (!cost_text.empty()) {
      return absl::InvalidArgumentError("modelled kernel costs apply to simulated devices only (device kind sim)");
    }
    return DeviceBackend(nullptr, ops);
  }
  if (kind == "sim") {
    auto costs = ParseCostModel(cost_text);
    if (!costs.ok()) return costs.status();
    return DeviceBackend(std::make_shared<const CostModel>(*std::move(costs)), ops);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown device kind '", kind, "'; known: cpu, sim"));
}

std::unique_ptr<Device> DeviceBackend::MakeDevice(int local_index, int64_t memory_bytes, const std::string& host_name,
                                                  absl::Duration kernel_memory_wait) const {
  if (costs_ != nullptr) {
    return std::make_unique<SimulatedDevice>(local_index, memory_bytes, host_name, kernel_memory_wait);
  }
  return std::make_unique<CpuDevice>(local_index, memory_bytes, host_name, kernel_memory_wait);
}

Compiler DeviceBackend::compiler() const {
  if (costs_ == nullptr) return [ops = ops_](const FunctionBody& body) { return CompileForCpu(body, ops); };
  return [costs = costs_](const FunctionBody& body) { return CompileModelled(body, costs); };
}

}  // namespace pathways
