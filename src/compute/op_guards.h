// Internal to the compute layer (it includes torch): what keeps a tenant's TorchScript body within
// its own tensors once it is compiled. Ops the worker's policy refuses (compute/function_ops.h)
// fail the compile; arguments that libtorch's kernels take on trust (an integer divisor of zero, a
// dtype number that names no dtype) get a check in front of them that fails the run instead of the
// worker.
#pragma once

#include <torch/csrc/jit/api/compilation_unit.h>

#include <string>

#include "absl/status/status.h"
#include "compute/function_ops.h"

namespace pathways {

// InvalidArgument naming the op, the file and line and why, for the first op that any function
// `unit` defines calls and `ops` refuses, or for a constant argument no check could let through.
// Otherwise puts the checks into every function's graph, and a stop point at the start of each
// loop's turn (compute/stop_request.h).
absl::Status ConfineBody(torch::jit::CompilationUnit& unit, const std::string& name, FunctionOps ops);

}  // namespace pathways
