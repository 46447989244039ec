// Deterministic f32 arrays for tests and benchmarks.
#pragma once

#include <cstdint>
#include <utility>

#include "core/types.h"

namespace pathways::testing {

// Elements uniform in [-scale, scale), the same for the same (shape, seed) everywhere.
inline HostArray RandomF32(Shape shape, uint32_t seed, float scale = 1) {
  HostArray a = *HostArray::Create(DType::kF32, std::move(shape));
  uint32_t state = seed * 2654435761u + 12345u;
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    state = state * 1664525u + 1013904223u;
    a.mutable_data<float>()[i] = scale * (static_cast<float>(state >> 8) / static_cast<float>(1 << 24) * 2 - 1);
  }
  return a;
}

}  // namespace pathways::testing
