// What a compiled function's body is, in a form that crosses process boundaries. Torch-free, so
// the client library can name bodies without linking the compute layer.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pathways {

struct FunctionBody {
  enum class Kind { kTorchScript = 0, kBuiltin = 1 };
  Kind kind = Kind::kBuiltin;
  std::string name;    // the function's name; for TorchScript, the `def` to call
  std::string source;  // TorchScript source; empty for built-ins

  // Set when the body is the vector-Jacobian product of the function that kind, name and source
  // describe (the primal). Its inputs are the primal's inputs, then one cotangent per
  // floating-point output of the primal; its outputs are the primal's outputs when
  // `with_outputs`, then the cotangents of the inputs in `wrt`. The body runs the primal's
  // forward pass again under libtorch's autograd (rematerialisation) and differentiates it.
  //
  // The partition specs of the primal's inputs and outputs (one mesh axis name or "" per
  // dimension) say along which mesh axes each value is replicated: a replicated output's
  // cotangent is shared among its replicas, and a replicated input's cotangent is the sum of
  // what each replica's shard contributes (an all_reduce over those axes).
  //
  // `residuals` says how the forward pass's intermediates reach the backward pass:
  // - kRecompute: as above, one body that runs the forward pass again (rematerialisation).
  // - kKeep: the forward half of a split product. Inputs: the primal's; outputs: the primal's,
  //   then a residual handle, an i64 scalar laid out replicated whose value is the bytes the kept
  //   residuals (and the outputs autograd holds) take on each device. The residuals stay on the
  //   device, with the handle's buffer, charged to the device's memory until the handle is freed.
  //   It takes no donated inputs (its graph views them).
  // - kUse: the backward half. Inputs: a kKeep handle of the same function and `wrt`, then one
  //   cotangent per floating-point output; outputs: the cotangents of the inputs in `wrt`. A
  //   handle carries its residuals only on the device that made it, and is used only in the gang
  //   (mesh, devices, shard) of the forward call that made it.
  // `with_outputs` applies to kRecompute only.
  enum class Residuals { kRecompute = 0, kKeep = 1, kUse = 2 };
  struct Gradient {
    std::vector<int> wrt;
    std::vector<std::vector<std::string>> in_specs;   // one per primal input
    std::vector<std::vector<std::string>> out_specs;  // one per primal output
    bool with_outputs = false;
    Residuals residuals = Residuals::kRecompute;
    bool operator==(const Gradient&) const = default;
  };
  std::optional<Gradient> gradient;
  // The file the source was written in, which TorchScript's errors and tracebacks then name ("" for
  // none: they say "<string>"); its lines are taken to be the source's.
  std::string source_file;

  // How IR, traces and errors name the function: its name, or vjp(name) for a gradient
  // (vjp_forward(name) and vjp_backward(name) for the halves of a split one).
  std::string DisplayName() const;
};

// Stable content hash of a body, as hex. Equal bodies get equal keys in every process, so a
// worker compiles each body once whoever sends it.
std::string FunctionKey(const FunctionBody& body);

// Checks what a body says about itself, for bodies that arrive from elsewhere: a known kind, a
// name, and a gradient whose inputs to differentiate are distinct primal inputs.
absl::Status ValidateFunctionBody(const FunctionBody& body);

}  // namespace pathways
