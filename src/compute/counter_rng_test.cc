#include "compute/counter_rng.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// Random123's known answers for Philox4x32-10 (its tests/kat_vectors).
TEST(CounterRngTest, PhiloxMatchesTheReferenceVectors) {
  EXPECT_EQ(PhiloxBlock({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(PhiloxBlock({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(PhiloxBlock({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

std::vector<float> Draw(RandomDistribution d, uint64_t seed, uint64_t step, std::vector<int64_t> global,
                        std::vector<int64_t> origin, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<float> out(static_cast<size_t>(n));
  FillRandom(d, seed, step, global, origin, shape, out.data());
  return out;
}

// A block of the global array holds exactly the global draw's elements there, whichever way the
// array is cut: shards of one array are pieces of one draw.
TEST(CounterRngTest, EveryBlockIsThePieceOfTheGlobalDraw) {
  for (RandomDistribution d : {RandomDistribution::kUniform, RandomDistribution::kNormal}) {
    const std::vector<float> whole = Draw(d, 7, 3, {6, 10}, {0, 0}, {6, 10});
    for (int64_t r0 : {0, 2, 3}) {
      for (int64_t c0 : {0, 1, 5}) {
        const std::vector<float> block = Draw(d, 7, 3, {6, 10}, {r0, c0}, {3, 5});
        for (int64_t r = 0; r < 3; ++r) {
          for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(block[r * 5 + c], whole[(r0 + r) * 10 + c0 + c]);
        }
      }
    }
  }
}

TEST(CounterRngTest, SeedsStepsAndDistributionsDrawDifferentNumbers) {
  const auto u = Draw(RandomDistribution::kUniform, 7, 3, {64}, {0}, {64});
  EXPECT_EQ(u, Draw(RandomDistribution::kUniform, 7, 3, {64}, {0}, {64}));  // reproducible
  EXPECT_NE(u, Draw(RandomDistribution::kUniform, 8, 3, {64}, {0}, {64}));
  EXPECT_NE(u, Draw(RandomDistribution::kUniform, 7, 4, {64}, {0}, {64}));
  // The element at a global index does not depend on the array's shape around it.
  EXPECT_EQ(Draw(RandomDistribution::kUniform, 7, 3, {8, 8}, {1, 0}, {1, 8}),
            std::vector<float>(u.begin() + 8, u.begin() + 16));
  const auto n = Draw(RandomDistribution::kNormal, 7, 3, {64}, {0}, {64});
  EXPECT_NE(n, Draw(RandomDistribution::kNormal, 7, 4, {64}, {0}, {64}));
}

TEST(CounterRngTest, DrawsHaveTheirDistributionsMoments) {
  constexpr int64_t kCount = 200000;
  const auto u = Draw(RandomDistribution::kUniform, 1, 0, {kCount}, {0}, {kCount});
  const auto n = Draw(RandomDistribution::kNormal, 1, 0, {kCount}, {0}, {kCount});
  double su = 0, sn = 0, sn2 = 0;
  for (int64_t i = 0; i < kCount; ++i) {
    ASSERT_GE(u[i], 0.0f);
    ASSERT_LT(u[i], 1.0f);
    ASSERT_TRUE(std::isfinite(n[i]));
    su += u[i];
    sn += n[i];
    sn2 += double{n[i]} * n[i];
  }
  EXPECT_NEAR(su / kCount, 0.5, 0.005);
  EXPECT_NEAR(sn / kCount, 0.0, 0.01);
  EXPECT_NEAR(sn2 / kCount, 1.0, 0.01);
}

}  // namespace
}  // namespace pathways
