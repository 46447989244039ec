#include "compute/markov.h"

#include <cmath>

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(MarkovSourceTest, RowsAreDistributionsAndTheEntropyRateIsBetweenNoneAndUniform) {
  auto source = MarkovSource::Get(256, 1234);
  ASSERT_TRUE(source.ok()) << source.status();
  const MarkovSource& m = **source;
  for (int i = 0; i < 256; i += 17) {
    double sum = 0;
    for (int j = 0; j < 256; ++j) sum += m.Transition(i, j);
    EXPECT_NEAR(sum, 1, 1e-12);
  }
  double pi_sum = 0;
  for (double p : m.stationary()) pi_sum += p;
  EXPECT_NEAR(pi_sum, 1, 1e-12);
  // Stationary: pi P = pi.
  for (int j = 0; j < 256; j += 31) {
    double next = 0;
    for (int i = 0; i < 256; ++i) next += m.stationary()[i] * m.Transition(i, j);
    EXPECT_NEAR(next, m.stationary()[j], 1e-12);
  }
  EXPECT_GT(m.EntropyRate(), 0.5);
  EXPECT_LT(m.EntropyRate(), std::log(256.0) - 0.5);
  // Sharper chains are more predictable; the same arguments give the same chain.
  EXPECT_LT((*MarkovSource::Get(256, 1234, 4.0))->EntropyRate(), m.EntropyRate());
  EXPECT_EQ(MarkovSource::Get(256, 1234)->get(), &m);
  EXPECT_NE((*MarkovSource::Get(256, 99))->Transition(0, 0), m.Transition(0, 0));
}

TEST(MarkovSourceTest, SamplesAreReproduciblePiecesOfOneBatchAndFollowTheChain) {
  const MarkovSource& m = **MarkovSource::Get(64, 7);
  const int64_t count = 64, length = 512;
  std::vector<int64_t> whole(count * length), again(count * length), part(16 * length), other(count * length);
  m.Sample(5, 3, 0, count, length, whole.data());
  m.Sample(5, 3, 0, count, length, again.data());
  EXPECT_EQ(whole, again);
  m.Sample(5, 3, 32, 16, length, part.data());  // sequences 32..47, drawn alone
  EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + 32 * length));
  m.Sample(5, 4, 0, count, length, other.data());  // the next step's batch differs
  EXPECT_NE(whole, other);
  // The average next-token loss of the true chain over the sample is its entropy rate.
  double nll = 0;
  int64_t n = 0;
  for (int64_t s = 0; s < count; ++s) {
    for (int64_t t = 1; t < length; ++t, ++n) {
      const int64_t prev = whole[s * length + t - 1], cur = whole[s * length + t];
      ASSERT_GE(cur, 0);
      ASSERT_LT(cur, 64);
      nll -= std::log(m.Transition(static_cast<int>(prev), static_cast<int>(cur)));
    }
  }
  EXPECT_NEAR(nll / static_cast<double>(n), m.EntropyRate(), 0.02 * m.EntropyRate());
}

TEST(MarkovSourceTest, BadArgumentsAreErrors) {
  EXPECT_EQ(MarkovSource::Get(1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MarkovSource::Get(MarkovSource::kMaxVocab + 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MarkovSource::Get(16, 0, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MarkovSource::Get(16, 0, std::nan("")).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pathways
