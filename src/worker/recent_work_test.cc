#include "worker/recent_work.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TraceEvent Event(const std::string& client, int64_t start, int64_t end) {
  return {WorkLabel{client, 1, 1, 0, 0, "f"}, start, end};
}

int64_t BusyOf(const rpc::WorkBucket& b, const std::string& client) {
  for (const rpc::ClientTime& t : b.busy()) {
    if (t.client_id() == client) return t.busy_micros();
  }
  return -1;
}

TEST(RecentWorkTest, DeviceTimeGoesToTheBucketsItFellInPerClient) {
  const std::string alice(32, 'a'), bob(32, 'b');
  // Widths of 100 µs: alice 50-250 spans three buckets, bob 120-130 one; the event that ended
  // at 40 was in the last heartbeat.
  std::vector<rpc::WorkBucket> buckets =
      RecentWork({Event(alice, 0, 40), Event(alice, 50, 250), Event(bob, 120, 130)}, /*after_us=*/40, 100);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_EQ(buckets[0].start_us(), 0);
  EXPECT_EQ(buckets[0].end_us(), 100);
  EXPECT_EQ(BusyOf(buckets[0], "aaaaaaaa"), 50);
  EXPECT_EQ(BusyOf(buckets[1], "aaaaaaaa"), 100);
  EXPECT_EQ(BusyOf(buckets[1], "bbbbbbbb"), 10);
  EXPECT_EQ(BusyOf(buckets[2], "aaaaaaaa"), 50);
  EXPECT_EQ(BusyOf(buckets[2], "bbbbbbbb"), -1);
}

TEST(RecentWorkTest, ManyComputationsStayWithinTheBoundNewestKept) {
  std::vector<TraceEvent> events;
  for (int i = 0; i < 100000; ++i) events.push_back(Event(i % 2 ? "alice" : "bob", i * 10, i * 10 + 5));
  std::vector<rpc::WorkBucket> buckets = RecentWork(events, -1, 1000, 16);
  ASSERT_EQ(buckets.size(), 16u);
  EXPECT_EQ(buckets.back().end_us(), 1'000'000);
  EXPECT_EQ(BusyOf(buckets.back(), "alice"), 250);  // 50 of alice's computations of 5 µs
  EXPECT_EQ(BusyOf(buckets.back(), "bob"), 250);
}

}  // namespace
}  // namespace pathways
