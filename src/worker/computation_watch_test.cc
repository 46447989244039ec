#include "worker/computation_watch.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

std::string Why(const ComputationWatch::Overrun& o) { return "stopped " + o.label.name; }

TEST(ComputationWatchTest, ComputationsPastTheLimitAreAskedToStopOnceAndTheirDevicesFlagged) {
  ComputationWatch watch(3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  watch.Begin(0, {.client = "0123456789abcdef", .run = 7, .shard = 2, .name = "spin"}, t0);
  watch.Begin(1, {.client = "c2", .name = "quick"}, t0 + absl::Seconds(5));
  EXPECT_TRUE(watch.StopLongerThan(absl::Seconds(10), t0 + absl::Seconds(10), Why).empty());  // not past it yet
  EXPECT_FALSE(watch.StopFlag(0)->load());
  EXPECT_FALSE(watch.StopReason(0).has_value());

  auto asked = watch.StopLongerThan(absl::Seconds(10), t0 + absl::Seconds(12), Why);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].device, 0);
  EXPECT_EQ(asked[0].running, absl::Seconds(12));
  EXPECT_TRUE(watch.StopFlag(0)->load());
  EXPECT_FALSE(watch.StopFlag(1)->load());
  EXPECT_EQ(watch.StopReason(0).value_or(""), "stopped spin");
  const std::string said = DescribeStop("127.0.0.1:9", asked[0], absl::Seconds(10));
  for (const char* part :
       {"device 0 of host 127.0.0.1:9", "'spin'", "run 7", "client 01234567", "12s", "10s", "asked it to stop"}) {
    EXPECT_NE(said.find(part), std::string::npos) << part << " in: " << said;
  }
  EXPECT_EQ(said.find("0123456789abcdef"), std::string::npos) << "the client's id, not its label: " << said;

  // Asked once: later checks ask only the one that overran since.
  asked = watch.StopLongerThan(absl::Seconds(10), t0 + absl::Seconds(16), Why);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].device, 1);
  // One that does not stop within the grace is named, the longest running first.
  EXPECT_FALSE(watch.NotStopped(absl::Seconds(5), t0 + absl::Seconds(16)).has_value());
  auto stuck = watch.NotStopped(absl::Seconds(5), t0 + absl::Seconds(21));
  ASSERT_TRUE(stuck.has_value());
  EXPECT_EQ(stuck->device, 0);
  EXPECT_EQ(stuck->running, absl::Seconds(21));
  const std::string left = DescribeOverrun("127.0.0.1:9", *stuck, absl::Seconds(10), absl::Seconds(5));
  for (const char* part : {"device 0 of host 127.0.0.1:9", "'spin'", "21s", "10s", "did not stop within 5s",
                           "cannot be preempted", "leaves the cluster"}) {
    EXPECT_NE(left.find(part), std::string::npos) << part << " in: " << left;
  }

  // One that stopped is no longer named; the next computation on its device starts unflagged.
  watch.End(0);
  stuck = watch.NotStopped(absl::Seconds(5), t0 + absl::Seconds(21));
  ASSERT_TRUE(stuck.has_value());
  EXPECT_EQ(stuck->device, 1);
  watch.Begin(0, {.name = "next"}, t0 + absl::Seconds(21));
  EXPECT_FALSE(watch.StopFlag(0)->load());
  EXPECT_FALSE(watch.StopReason(0).has_value());
  watch.End(1);
  EXPECT_FALSE(watch.NotStopped(absl::Seconds(5), t0 + absl::Seconds(30)).has_value());

  // Devices it does not have are ignored, not a crash.
  watch.Begin(3, {}, t0);
  watch.End(-1);
  EXPECT_EQ(watch.StopFlag(3), nullptr);
  EXPECT_FALSE(watch.StopReason(-1).has_value());
}

}  // namespace
}  // namespace pathways
