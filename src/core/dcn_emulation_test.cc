#include "core/dcn_emulation.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(DcnEmulationTest, OnlyTrafficToAnotherIslandIsDelayed) {
  DcnEmulation dcn(0, {.latency = absl::Milliseconds(5), .gbps = 8});  // 1 GB/s: 1 MB takes 1 ms
  dcn.NoteHost("same", 0);
  dcn.NoteHost("other", 1);
  const absl::Time now = absl::FromUnixSeconds(1000);
  EXPECT_EQ(dcn.Arrival("same", 1'000'000, now), now);
  EXPECT_EQ(dcn.Arrival("unknown", 1'000'000, now), now);
  EXPECT_FALSE(dcn.Crosses("same"));
  EXPECT_TRUE(dcn.Crosses("other"));
  EXPECT_EQ(dcn.Arrival("other", 1'000'000, now), now + absl::Milliseconds(6));
}

TEST(DcnEmulationTest, MessagesOnOneLinkFollowEachOther) {
  DcnEmulation dcn(0, {.latency = absl::Milliseconds(5), .gbps = 8});
  dcn.NoteHost("a", 1);
  dcn.NoteHost("b", 2);
  const absl::Time now = absl::FromUnixSeconds(1000);
  EXPECT_EQ(dcn.Arrival("a", 1'000'000, now), now + absl::Milliseconds(6));
  // Sent at the same moment, the second waits for the first to leave the wire.
  EXPECT_EQ(dcn.Arrival("a", 1'000'000, now), now + absl::Milliseconds(7));
  // Another peer's link is free.
  EXPECT_EQ(dcn.Arrival("b", 1'000'000, now), now + absl::Milliseconds(6));
  // Without a bandwidth, only the latency.
  DcnEmulation latency_only(0, {.latency = absl::Microseconds(50)});
  latency_only.NoteHost("a", 1);
  EXPECT_EQ(latency_only.Arrival("a", 1 << 30, now), now + absl::Microseconds(50));
}

}  // namespace
}  // namespace pathways
