#include "core/log_limiter.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(LogLimiterTest, SaysTheFirstThenCountsWhatItLeavesUnsaidUntilTheIntervalPasses) {
  LogLimiter limiter(absl::Milliseconds(20));
  ASSERT_TRUE(limiter.Say());
  EXPECT_EQ(limiter.Unsaid("left out"), "");
  // Within the interval (the clock is read once per call; the calls take microseconds).
  const absl::Time start = absl::Now();
  int64_t counted = 0;
  bool said = false;
  while (!said && absl::Now() - start < absl::Seconds(5)) {  // bounded: the interval is 20 ms
    said = limiter.Say(3);
    if (!said) counted += 3;
  }
  ASSERT_TRUE(said);
  // (None counted only if this thread was kept off a core for the whole interval.)
  EXPECT_EQ(limiter.Unsaid("left out"), counted > 0 ? absl::StrCat(" (", counted, " left out)") : "");
}

TEST(LogLimiterTest, WithinTheIntervalNothingIsSaid) {
  LogLimiter limiter(absl::Hours(1));
  ASSERT_TRUE(limiter.Say());
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Say(2));
}

TEST(LogLimiterTest, AnIntervalOfZeroSaysEverything) {
  LogLimiter limiter(absl::ZeroDuration());
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(limiter.Say());
    EXPECT_EQ(limiter.Unsaid("left out"), "");
  }
}

}  // namespace
}  // namespace pathways
