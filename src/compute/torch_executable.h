// Internal to the compute layer (it includes torch): the executables that run libtorch bodies on
// device buffers, shared by the primal bodies (torch_executable.cc) and their vector-Jacobian
// products (vjp_executable.cc).
#pragma once

// ivalue.h before torch.h: clang 14 in C++20 (the sanitizer builds) otherwise instantiates
// std::vector<IValue> in List.h while IValue is still incomplete.
#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "compute/executable.h"
#include "compute/function_body.h"

namespace pathways {

// The device buffers a body runs on, for bodies that read or set what they carry besides bytes.
struct Buffers {
  absl::Span<const DeviceBuffer* const> inputs;
  absl::Span<DeviceBuffer* const> outputs;
};

// Runs the body-specific part; the common part (viewing, checking, copying out) is shared.
class TorchExecutable : public Executable {
 public:
  explicit TorchExecutable(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }

  absl::Status Run(absl::Span<const DeviceBuffer* const> inputs,
                   absl::Span<DeviceBuffer* const> outputs) const override;

  // Runs the body on torch views of the inputs.
  virtual absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args,
                                                         const Buffers& buffers) const = 0;

 protected:
  virtual bool differentiates() const { return false; }
  // Whether the views of the inputs keep their buffers alive (they may outlive the call).
  virtual bool keeps_input_views() const { return false; }

 private:
  std::string name_;
};

// The vector-Jacobian product of `primal` (see vjp_executable.cc); `forward_key` is the
// FunctionKey of its forward half, split.
std::shared_ptr<const Executable> MakeVjpExecutable(std::string name, std::shared_ptr<const TorchExecutable> primal,
                                                    FunctionBody::Gradient gradient, std::string forward_key);

}  // namespace pathways
