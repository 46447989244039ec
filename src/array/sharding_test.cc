#include "array/sharding.h"

#include <numeric>

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(MeshTest, ValidatesShapeAndNames) {
  EXPECT_TRUE(Mesh::Create({2, 4}).ok());
  EXPECT_EQ(Mesh::Create({2, 4})->axis_names, (std::vector<std::string>{"x", "y"}));
  EXPECT_FALSE(Mesh::Create({}).ok());
  EXPECT_FALSE(Mesh::Create({2, 0}).ok());
  EXPECT_FALSE(Mesh::Create({2, 2}, {"a", "a"}).ok());
  // A name a collective's comma-separated axes could never name is refused.
  for (const std::string& bad :
       std::vector<std::string>{"a,b", std::string("a\0b", 3), " a", "a ", std::string(65, 'a')}) {
    auto mesh = Mesh::Create({2, 2}, {"x", bad});
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(Mesh::Create({2, 2}, {"data_parallel", "stage-1"}).ok());
  EXPECT_FALSE(Mesh::Create({1000, 1000, 1000}).ok());  // a billion devices
}

TEST(ShardingTest, SplitsRowsAndReplicatesAlongUnusedAxis) {
  Mesh mesh = *Mesh::Create({2, 4}, {"a", "b"});
  auto s = Sharding::Create(mesh, {"b", ""}, {8, 6});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->local_shape(), (Shape{2, 6}));
  // Device 5 has coordinates (1, 1): rows 2..3, replicated along a.
  EXPECT_EQ(s->ShardRegion(5), (Region{{2, 0}, {2, 6}}));
  EXPECT_EQ(s->ShardRegion(1), s->ShardRegion(5));
}

TEST(ShardingTest, ADimensionSplitOverTwoAxesHasTheFirstMajor) {
  Mesh mesh = *Mesh::Create({2, 4}, {"a", "b"});
  auto s = Sharding::Create(mesh, {"a,b", ""}, {16, 3});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->local_shape(), (Shape{2, 3}));
  // Device k at (k / 4, k % 4) holds block 4 * a + b = k of the rows.
  for (int64_t k = 0; k < 8; ++k) EXPECT_EQ(s->ShardRegion(k), (Region{{2 * k, 0}, {2, 3}})) << k;
  auto swapped = Sharding::Create(mesh, {"", "b,a"}, {3, 16});
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  // Device 1 at (0, 1): block 2 * b + a = 2.
  EXPECT_EQ(swapped->ShardRegion(1), (Region{{0, 4}, {3, 2}}));
  EXPECT_EQ(PartitionSpecToString(swapped->spec()), "(-,(b,a))");
  EXPECT_FALSE(Sharding::Create(mesh, {"a,b", ""}, {12, 3}).ok());  // 12 % 8 != 0
  EXPECT_FALSE(Sharding::Create(mesh, {"a,a", ""}, {16, 3}).ok());  // twice
  EXPECT_FALSE(Sharding::Create(mesh, {"a,b", "b"}, {16, 4}).ok());
  EXPECT_FALSE(Sharding::Create(mesh, {"a,q", ""}, {16, 3}).ok());
  EXPECT_FALSE(Sharding::Create(mesh, {"a,", ""}, {16, 3}).ok());  // an empty name
}

TEST(ShardingTest, RejectsBadSpecs) {
  Mesh mesh = *Mesh::Create({4});
  EXPECT_FALSE(Sharding::Create(mesh, {"x"}, {6}).ok());        // 6 % 4 != 0
  EXPECT_FALSE(Sharding::Create(mesh, {"q"}, {8}).ok());        // unknown axis
  EXPECT_FALSE(Sharding::Create(mesh, {"x", "x"}, {8, 8}).ok()); // axis used twice
  EXPECT_FALSE(Sharding::Create(mesh, {"x"}, {8, 8}).ok());      // rank mismatch
  EXPECT_TRUE(Sharding::Create(mesh, {}, {8, 8}).ok());          // replicated
}

TEST(RegionTest, IntersectAndCopy) {
  auto r = Intersect({{0, 0}, {4, 4}}, {{2, 3}, {4, 4}});
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, (Region{{2, 3}, {2, 1}}));
  EXPECT_FALSE(Intersect({{0}, {2}}, {{2}, {2}}).has_value());

  // Copy the 2x2 block at (1,1) of a 3x4 array into the top-right of a 2x3 array.
  std::vector<int32_t> src(12);
  std::iota(src.begin(), src.end(), 0);
  std::vector<int32_t> dst(6, -1);
  CopyRegion(reinterpret_cast<const char*>(src.data()), {3, 4}, {1, 1}, {2, 2}, 4,
             reinterpret_cast<char*>(dst.data()), {2, 3}, {0, 1});
  EXPECT_EQ(dst, (std::vector<int32_t>{-1, 5, 6, -1, 9, 10}));
}

TEST(RegionTest, CheckInside) {
  EXPECT_TRUE(CheckRegionInside({{1}, {2}}, {3}).ok());
  EXPECT_FALSE(CheckRegionInside({{2}, {2}}, {3}).ok());
  EXPECT_FALSE(CheckRegionInside({{0}, {1}}, {3, 3}).ok());
}

TEST(ShardingTest, ContiguousSpanFindsRunsOfTheRowMajorArray) {
  using Span = std::optional<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(ContiguousSpan({4, 3}, {{0, 0}, {4, 3}}), Span(std::make_pair(0, 12)));  // whole
  EXPECT_EQ(ContiguousSpan({4, 3}, {{1, 0}, {2, 3}}), Span(std::make_pair(3, 6)));   // whole rows
  EXPECT_EQ(ContiguousSpan({4, 3}, {{2, 1}, {1, 2}}), Span(std::make_pair(7, 2)));   // part of one row
  EXPECT_EQ(ContiguousSpan({4, 3}, {{0, 1}, {2, 2}}), std::nullopt);                 // a column block
  EXPECT_EQ(ContiguousSpan({2, 4, 3}, {{1, 2, 0}, {1, 2, 3}}), Span(std::make_pair(18, 6)));
  EXPECT_EQ(ContiguousSpan({}, {{}, {}}), Span(std::make_pair(0, 1)));  // a scalar
}

}  // namespace
}  // namespace pathways
