// Builds one shard's input on its device from the blocks it is assembled from (local buffers
// and blocks received from other hosts), copying each block's region into place.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "array/sharding.h"
#include "core/types.h"
#include "device/device.h"

namespace pathways {

// One input of one shard: its local spec and where its pieces go.
struct InputPlan {
  TensorSpec spec;
  std::vector<Region> src_regions;  // of each piece's buffer
  std::vector<Shape> dst_starts;    // where each piece lands in the input
  size_t first_piece = 0;           // index into the flattened piece buffers
};

// Builds the input on `device` from `pieces` (the flattened buffers of every input of the
// shard). When the input is exactly one whole buffer on the same device it is used as is,
// without a copy. InvalidArgument when a piece does not fit; ResourceExhausted when the device's
// memory stays full for `memory_wait`.
absl::StatusOr<BufferPtr> AssembleInput(Device& device, absl::Duration memory_wait, const InputPlan& plan,
                                        const std::vector<BufferPtr>& pieces);

}  // namespace pathways
