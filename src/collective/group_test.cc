#include "collective/group.h"

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

TEST(GroupOfTest, AxesHaveOneSpelling) {
  EXPECT_EQ(CanonicalAxes(" y , x "), "y,x");
  EXPECT_EQ(CanonicalAxes("x"), "x");
  EXPECT_EQ(CanonicalAxes("   "), "");
  EXPECT_EQ(CanonicalAxes("x,,y"), "x,,y") << "left for GroupOf to refuse";
}

TEST(GroupOfTest, GroupsFollowTheNamedAxes) {
  GangLayout layout{{2, 3}, {"x", "y"}, {}};
  for (int32_t d = 0; d < 6; ++d) layout.members.push_back({"h", DeviceId(d)});
  auto y = GroupOf(layout, 4, "y");  // shard 4 is at (1, 1)
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shards, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(y->rank, 1);
  EXPECT_EQ(y->label, "over [y] at x=1 (3 members)");
  auto x = GroupOf(layout, 4, "x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->shards, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(x->rank, 1);
  EXPECT_NE(x->id, GroupOf(layout, 5, "x")->id);
  EXPECT_EQ(x->id, GroupOf(layout, 1, "x")->id);
  auto all = GroupOf(layout, 4, "");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->shards, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(all->rank, 4);
  EXPECT_EQ(all->label, "over [x, y] (6 members)");
  auto yx = GroupOf(layout, 4, "y, x");  // y varies slowest
  ASSERT_TRUE(yx.ok());
  EXPECT_EQ(yx->shards, (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(yx->rank, 3);
  EXPECT_EQ(GroupOf(layout, 0, "z").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GroupOf(layout, 0, "x,x").status().code(), absl::StatusCode::kInvalidArgument);
}

// A 2x2 mesh whose rows are on hosts "b" and "a": hosts are sorted, whatever the mesh's order.
TEST(PlaceGroupTest, HostsSortedAndEachRanksHostNamed) {
  GangLayout layout{{2, 2}, {"x", "y"}, {{"b", DeviceId(0)}, {"b", DeviceId(1)}, {"a", DeviceId(2)}, {"a", DeviceId(3)}}};
  auto column = PlaceGroup(layout, 1, "x", "b");  // shards 1 (on b) and 3 (on a)
  ASSERT_TRUE(column.ok()) << column.status();
  EXPECT_EQ(column->hosts, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(column->host_of, (std::vector<int>{1, 0}));
  EXPECT_EQ(column->mine, 1);
  EXPECT_EQ(column->local, (std::vector<int>{0}));
  EXPECT_EQ(column->devices, "a/3,b/1");
  auto row = PlaceGroup(layout, 2, "y", "a");  // shards 2 and 3, both on a
  ASSERT_TRUE(row.ok()) << row.status();
  EXPECT_EQ(row->hosts, (std::vector<std::string>{"a"}));
  EXPECT_EQ(row->local, (std::vector<int>{0, 1}));
  // A host that holds no member of the shard's group is a planning error, named.
  auto elsewhere = PlaceGroup(layout, 2, "y", "b");
  EXPECT_EQ(elsewhere.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(elsewhere.status().message().find("runs on host b"), std::string::npos) << elsewhere.status();
}

}  // namespace
}  // namespace pathways::collective
