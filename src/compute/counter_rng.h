// Counter-based random numbers for compiled functions (Philox4x32-10: Salmon, Moraes, Dror and
// Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011). The value of an element depends
// only on (seed, step, the element's index in the global array), so:
// - a run is reproducible, whatever the number of devices or hosts;
// - the shards of one array hold the pieces of one global draw: they differ where the array is
//   split over devices and agree where a sharding replicates it;
// - no generator state lives anywhere: a step number replaces it.
// Torch-free; the compute layer wraps it as `pathways.uniform`, `pathways.normal` and
// `pathways.dropout` (compute/executable.h).
#pragma once

#include <array>
#include <cstdint>

#include "absl/types/span.h"

namespace pathways {

// One Philox4x32-10 block: four 32-bit words from a 128-bit counter and a 64-bit key.
std::array<uint32_t, 4> PhiloxBlock(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

enum class RandomDistribution {
  kUniform,  // in [0, 1)
  kNormal,   // mean 0, standard deviation 1
};

// Fills `out` (row-major, of `shape`) with the elements of a global array of shape `global`
// drawn from `distribution` under (seed, step), for the block of it that starts at `origin`.
// `shape`, `global` and `origin` have one entry per dimension; origin + shape <= global.
void FillRandom(RandomDistribution distribution, uint64_t seed, uint64_t step, absl::Span<const int64_t> global,
                absl::Span<const int64_t> origin, absl::Span<const int64_t> shape, float* out);

}  // namespace pathways
