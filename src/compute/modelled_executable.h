// Kernels whose duration is modelled instead of computed, for simulated devices
// (device/simulated_device.h): one machine can then run the real client, controller, schedulers
// and workers of a cluster of thousands of devices, with every mechanism around the kernel real.
// Torch-free.
#pragma once

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compute/executable.h"

namespace pathways {

// How long each function's kernel takes on a simulated device. Immutable once built.
struct CostModel {
  // Used for functions not named in `by_function`.
  absl::Duration default_cost = absl::Microseconds(100);
  // By the function's display name ("add_one", "vjp(layer)", "all_reduce_sum@x"), or for
  // built-in collectives also by the kernel's name before '@'.
  absl::flat_hash_map<std::string, absl::Duration> by_function;

  absl::Duration CostOf(const std::string& display_name) const;
};

// Parses "NAME=MICROS,NAME=MICROS,...", where NAME `*` sets the default: the form of the
// `--sim-cost-us` flag. Empty gives the defaults. InvalidArgument naming the bad entry otherwise.
absl::StatusOr<CostModel> ParseCostModel(const std::string& text);

// Compiles a body for a simulated device: checks what the body says about itself (its kind, name
// and gradient) and that a built-in kernel exists (TorchScript is not parsed, so a syntax error
// surfaces only on a real device), and
// returns an executable that, on the device's stream:
//  - keeps the stream busy for the modelled duration (sleeping, so that thousands of simulated
//    devices share two cores);
//  - then, when the body calls a collective, meets the rest of its gang once through the host's
//    collectives: one 4-byte all_reduce over the gang's axes (or the axes a built-in collective
//    names), a rendezvous as real as a computed collective's, with the bytes of none; a body that
//    calls several collectives meets once;
//  - writes zeros into its outputs, which the caller allocated and charged as for a real kernel.
absl::StatusOr<std::shared_ptr<const Executable>> CompileModelled(const FunctionBody& body,
                                                                  std::shared_ptr<const CostModel> costs);

}  // namespace pathways
