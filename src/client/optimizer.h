// Optimizers as compiled functions over sharded parameters: each update runs on the devices that
// hold the parameter's shards, element-wise, and updates the parameter and its state in place
// (they are donated), so a step holds one copy of them.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace pathways {

// Adam (Kingma & Ba, 2015), with decoupled weight decay (AdamW, Loshchilov & Hutter) when
// `weight_decay` is set.
struct AdamOptions {
  double learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  double weight_decay = 0;
};

// The update of one parameter laid out by `sharding`: inputs (param, grad, m, v, count) and
// outputs (param, m, v, count), where m and v are the moment estimates (shaped and laid out as
// the parameter, zeros at first) and count is a replicated f32 scalar, the number of steps taken
// (zero at first). param, m, v and count are donated. Fails for a parameter that is not f32 or
// options out of range.
absl::StatusOr<FunctionSpec> AdamUpdate(const TensorSpec& param, const PartitionSpec& sharding,
                                        const AdamOptions& options = {});

// The update of several parameters (all on one slice) in one call, sharing one step count:
// inputs (params..., grads..., m..., v..., count), outputs (params..., m..., v..., count), each
// group in the order of `params`. A model's step then costs one call per slice, not one per
// parameter. AdamUpdate is the group of one.
absl::StatusOr<FunctionSpec> AdamUpdateGroup(const std::vector<TensorSpec>& params,
                                             const std::vector<PartitionSpec>& shardings,
                                             const AdamOptions& options = {});

}  // namespace pathways
