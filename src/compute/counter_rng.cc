#include "compute/counter_rng.h"

#include <cmath>
#include <vector>

namespace pathways {
namespace {

constexpr uint32_t kMul0 = 0xD2511F53, kMul1 = 0xCD9E8D57;  // the round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9, kWeyl1 = 0xBB67AE85;  // the key schedule's increments
constexpr float kTwoToMinus24 = 1.0f / 16777216.0f;

// A float in [0, 1) from the top 24 bits of a word (every value exactly representable).
float Unit(uint32_t word) { return static_cast<float>(word >> 8) * kTwoToMinus24; }

}  // namespace

std::array<uint32_t, 4> PhiloxBlock(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * c[0];
    const uint64_t p1 = uint64_t{kMul1} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

void FillRandom(RandomDistribution distribution, uint64_t seed, uint64_t step, absl::Span<const int64_t> global,
                absl::Span<const int64_t> origin, absl::Span<const int64_t> shape, float* out) {
  const int rank = static_cast<int>(shape.size());
  const std::array<uint32_t, 2> key = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  // The two distributions draw from disjoint counters: the step's top bit tells them apart.
  const uint32_t step_hi = static_cast<uint32_t>(step >> 32) ^ (distribution == RandomDistribution::kNormal ? 0x80000000u : 0);
  auto block = [&](uint64_t n) {
    return PhiloxBlock({static_cast<uint32_t>(n), static_cast<uint32_t>(n >> 32), static_cast<uint32_t>(step), step_hi},
                       key);
  };
  // Row by row (the last dimension): a local row is a run of consecutive global indices.
  std::vector<int64_t> strides(rank, 1);
  for (int d = rank - 2; d >= 0; --d) strides[d] = strides[d + 1] * global[d + 1];
  const int64_t row = rank == 0 ? 1 : shape[rank - 1];
  int64_t rows = 1;
  for (int d = 0; d + 1 < rank; ++d) rows *= shape[d];
  if (row == 0) return;
  std::vector<int64_t> at(rank > 0 ? rank - 1 : 0, 0);  // the row's index in the local block
  for (int64_t r = 0; r < rows; ++r, out += row) {
    uint64_t first = rank == 0 ? 0 : static_cast<uint64_t>(origin[rank - 1]);
    for (int d = 0; d + 1 < rank; ++d) first += static_cast<uint64_t>((origin[d] + at[d]) * strides[d]);
    if (distribution == RandomDistribution::kUniform) {
      // Four elements per block: element g takes word g % 4 of block g / 4.
      std::array<uint32_t, 4> words{};
      uint64_t held = ~uint64_t{0};
      for (int64_t i = 0; i < row; ++i) {
        const uint64_t g = first + static_cast<uint64_t>(i);
        if (g / 4 != held) {
          held = g / 4;
          words = block(held);
        }
        out[i] = Unit(words[g % 4]);
      }
    } else {
      // Box-Muller from the first two words of block g.
      for (int64_t i = 0; i < row; ++i) {
        const std::array<uint32_t, 4> w = block(first + static_cast<uint64_t>(i));
        const float u1 = Unit(w[0]) + kTwoToMinus24;  // in (0, 1]: the logarithm stays finite
        const float u2 = Unit(w[1]);
        out[i] = std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530717958647692f * u2);
      }
    }
    for (int d = rank - 2; d >= 0; --d) {  // the next row
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
}

}  // namespace pathways
