// The compute layer's interface: compiled function bodies that run on one device's buffers.
// Only this layer's .cc files include torch headers; everything here is backend-neutral.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compute/function_body.h"
#include "compute/function_ops.h"
#include "device/device.h"

namespace pathways {

// A compiled body, ready to run on local shards. Thread-safe: devices run it concurrently.
class Executable {
 public:
  virtual ~Executable() = default;
  virtual const std::string& name() const = 0;
  // Runs the body on `inputs` and writes its results into `outputs`, which the caller allocated
  // with the signature's local output specs. Any failure, including a result whose shape or dtype
  // differs from its output buffer, is returned as a Status naming the function.
  virtual absl::Status Run(absl::Span<const DeviceBuffer* const> inputs,
                           absl::Span<DeviceBuffer* const> outputs) const = 0;
  // The host memory it keeps for as long as it is cached: its graph, and the constants compiling
  // folded from its source.
  virtual int64_t held_bytes() const { return 0; }
};

// Names of the built-in C++ kernels, for error messages and `pathways status`.
std::vector<std::string> BuiltinKernelNames();

// Turns a body into an executable for one kind of device.
using Compiler = std::function<absl::StatusOr<std::shared_ptr<const Executable>>(const FunctionBody&)>;

// Compiles bodies to libtorch on CPU devices: built-in kernels and TorchScript, whose ops `ops`
// names (InvalidArgument naming an op it refuses, with its file and line).
absl::StatusOr<std::shared_ptr<const Executable>> CompileForCpu(const FunctionBody& body,
                                                                FunctionOps ops = FunctionOps::kVetted);

// Sets libtorch's intra-op threads (default 1: devices are the parallelism) and OpenBLAS's, and
// (once per process) routes libtorch's CPU allocations through HostMemory's cache.
void ConfigureComputeThreads(int intra_op_threads);

}  // namespace pathways
