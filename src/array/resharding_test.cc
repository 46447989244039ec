#include "array/resharding.h"

#include <numeric>

#include "gtest/gtest.h"

namespace pathways {
namespace {

std::vector<DeviceLocation> Devices(int n, int per_host, int first_id = 0) {
  std::vector<DeviceLocation> d;
  for (int i = 0; i < n; ++i) d.push_back({DeviceId(first_id + i), "h" + std::to_string(i / per_host)});
  return d;
}

// Assembles every destination shard from the plan and checks it against the global array.
void CheckPlanCoversEverything(const Sharding& src, const std::vector<DeviceLocation>& src_dev,
                               const Sharding& dst, const std::vector<DeviceLocation>& dst_dev) {
  const Shape& global = src.global_shape();
  int64_t n = *NumElements(global);
  std::vector<int32_t> data(n);
  std::iota(data.begin(), data.end(), 0);
  auto shard_data = [&](const Sharding& s, int64_t i) {
    Region r = s.ShardRegion(i);
    std::vector<int32_t> out(*NumElements(s.local_shape()));
    CopyRegion(reinterpret_cast<const char*>(data.data()), global, r.start, r.size, 4,
               reinterpret_cast<char*>(out.data()), s.local_shape(), Shape(global.size(), 0));
    return out;
  };
  for (int64_t d = 0; d < dst.num_shards(); ++d) {
    std::vector<int32_t> assembled(*NumElements(dst.local_shape()), -1);
    for (const Piece& p : PlanShard({&src, &src_dev}, {&dst, &dst_dev}, d)) {
      std::vector<int32_t> from = shard_data(src, p.src_shard);
      CopyRegion(reinterpret_cast<const char*>(from.data()), src.local_shape(), p.src_region.start,
                 p.src_region.size, 4, reinterpret_cast<char*>(assembled.data()), dst.local_shape(),
                 p.dst_start);
    }
    EXPECT_EQ(assembled, shard_data(dst, d)) << "destination shard " << d;
  }
}

TEST(ReshardingTest, EveryLayoutPairAssemblesCorrectly) {
  Mesh m8 = *Mesh::Create({8});
  Mesh m24 = *Mesh::Create({2, 4});
  Mesh m42 = *Mesh::Create({4, 2}, {"a", "b"});
  std::vector<Sharding> layouts = {
      *Sharding::Create(m8, {"x", ""}, {16, 8}),   *Sharding::Create(m8, {"", "x"}, {16, 8}),
      *Sharding::Create(m8, {}, {16, 8}),          *Sharding::Create(m24, {"x", "y"}, {16, 8}),
      *Sharding::Create(m24, {"y", ""}, {16, 8}),  *Sharding::Create(m42, {"b", "a"}, {16, 8}),
      *Sharding::Create(m24, {"x,y", ""}, {16, 8}), *Sharding::Create(m24, {"", "y,x"}, {16, 8}),
      *Sharding::Create(m42, {"a,b", ""}, {16, 8}),
  };
  auto dev_a = Devices(8, 4);
  auto dev_b = Devices(8, 2, 100);
  for (const auto& src : layouts) {
    for (const auto& dst : layouts) {
      SCOPED_TRACE(PartitionSpecToString(src.spec()) + " -> " + PartitionSpecToString(dst.spec()));
      CheckPlanCoversEverything(src, dev_a, dst, dev_a);
      CheckPlanCoversEverything(src, dev_a, dst, dev_b);
    }
  }
}

TEST(ReshardingTest, PrefersReplicaOnSameDeviceThenSameHost) {
  Mesh m = *Mesh::Create({8});
  Sharding replicated = *Sharding::Create(m, {}, {4});
  auto devices = Devices(8, 4);
  for (int64_t d = 0; d < 8; ++d) {
    auto pieces = PlanShard({&replicated, &devices}, {&replicated, &devices}, d);
    ASSERT_EQ(pieces.size(), 1u);
    EXPECT_EQ(pieces[0].src_shard, d);
  }
  auto others = Devices(8, 4, 100);  // same hosts, other devices
  others[5].host = "h1";
  auto pieces = PlanShard({&replicated, &devices}, {&replicated, &others}, 5);
  EXPECT_EQ(pieces[0].src_shard, 4);  // lowest shard on host h1
  auto far = Devices(8, 4, 100);
  for (auto& d : far) d.host = "elsewhere";
  EXPECT_EQ(PlanShard({&replicated, &devices}, {&replicated, &far}, 6)[0].src_shard, 0);
}

TEST(ReshardingTest, IdenticalLayoutIsOnePieceEvenAtManyShards) {
  Mesh m = *Mesh::Create({1024});
  Sharding s = *Sharding::Create(m, {"x"}, {4096});
  auto devices = Devices(1024, 256);
  auto pieces = PlanShard({&s, &devices}, {&s, &devices}, 777);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].src_shard, 777);
  EXPECT_EQ(pieces[0].src_region, (Region{{0}, {4}}));
}

}  // namespace
}  // namespace pathways
