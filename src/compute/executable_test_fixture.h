// The fixture executable_test's files share: a CPU device, a function cache and float buffers.
#pragma once

#include <cstring>
#include <vector>

#include "compute/executable.h"
#include "compute/function_cache.h"
#include "device/cpu_device.h"
#include "gtest/gtest.h"

namespace pathways {

inline std::vector<float> Values(const DeviceBuffer& b) {
  const float* p = reinterpret_cast<const float*>(b.data());
  return std::vector<float>(p, p + b.byte_size() / sizeof(float));
}

struct TanhCase;

class ExecutableTest : public ::testing::Test {
 protected:
  BufferPtr MakeF32(const Shape& shape, std::vector<float> values) {
    BufferPtr b = *device_.Allocate(DType::kF32, shape);
    std::memcpy(b->data(), values.data(), values.size() * sizeof(float));
    return b;
  }
  // Runs `exe` on a one-element float `x`; its one-element output goes to `result`.
  absl::Status RunScalar(const Executable& exe, float x, float* result) {
    BufferPtr in = MakeF32({1}, {x});
    BufferPtr out = *device_.Allocate(DType::kF32, {1});
    const DeviceBuffer* ins[] = {in.get()};
    DeviceBuffer* outs[] = {out.get()};
    absl::Status s = exe.Run(ins, outs);
    *result = Values(*out)[0];
    return s;
  }
  TanhCase MakeTanhCase();  // executable_test.cc
  CpuDevice device_{0, 1 << 20};
  FunctionCache cache_;
};

}  // namespace pathways
