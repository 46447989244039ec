#include "worker/computation_watch.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(ComputationWatchTest, OnlyAComputationStillRunningPastTheLimitIsAnOverrunAndTheLongestIsNamed) {
  ComputationWatch watch(3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  watch.Begin(0, {.client = "0123456789abcdef", .run = 7, .shard = 2, .name = "spin"}, t0);
  watch.Begin(1, {.client = "c2", .name = "quick"}, t0 + absl::Seconds(5));
  EXPECT_FALSE(watch.LongerThan(absl::Seconds(10), t0 + absl::Seconds(10)).has_value());  // not past it yet

  auto over = watch.LongerThan(absl::Seconds(10), t0 + absl::Seconds(16));
  ASSERT_TRUE(over.has_value());
  EXPECT_EQ(over->device, 0);  // both overran; the one running longest is named
  EXPECT_EQ(over->running, absl::Seconds(16));
  const std::string said = DescribeOverrun("127.0.0.1:9", *over, absl::Seconds(10));
  for (const char* part : {"device 0 of host 127.0.0.1:9", "'spin'", "run 7", "client 01234567", "16s", "10s"}) {
    EXPECT_NE(said.find(part), std::string::npos) << part << " in: " << said;
  }
  EXPECT_EQ(said.find("0123456789abcdef"), std::string::npos) << "the client's id, not its label: " << said;

  // A device that finished is not overrunning, whenever it began; a new computation starts afresh.
  watch.End(0);
  over = watch.LongerThan(absl::Seconds(10), t0 + absl::Seconds(16));
  ASSERT_TRUE(over.has_value());
  EXPECT_EQ(over->device, 1);
  watch.End(1);
  watch.Begin(1, {.name = "next"}, t0 + absl::Seconds(16));
  EXPECT_FALSE(watch.LongerThan(absl::Seconds(10), t0 + absl::Seconds(20)).has_value());

  // Devices it does not have are ignored, not a crash.
  watch.Begin(3, {}, t0);
  watch.End(-1);
}

}  // namespace
}  // namespace pathways
