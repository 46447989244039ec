// The emulated data-centre network on an embedded cluster: an array computed on one island and
// consumed on the other crosses it, and waits for it; collectives over both islands too.
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

constexpr absl::Duration kLatency = absl::Milliseconds(100);

class DcnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cluster = LocalCluster::Start({.num_islands = 2, .hosts_per_island = 1, .devices_per_host = 2,
                                        .device_memory_bytes = 16 << 20, .dcn = {.latency = kLatency}});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    auto client = cluster_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Client> client_;
};

TEST_F(DcnTest, AnArrayMovedToAnotherIslandArrivesAfterTheLatency) {
  auto island0 = client_->CreateSlice({.mesh_shape = {2}, .island = 0});
  auto island1 = client_->CreateSlice({.mesh_shape = {2}, .island = 1});
  ASSERT_TRUE(island0.ok() && island1.ok());
  const TensorSpec spec{DType::kF32, {2, 4}};
  auto inc = client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x", ""}}, {{"x", ""}}));
  ASSERT_TRUE(inc.ok()) << inc.status();
  auto x = client_->Put(*HostArray::Create(DType::kF32, {2, 4}), *island0, {"x", ""});
  ASSERT_TRUE(x.ok()) << x.status();
  // Warm up: programs registered, connections made.
  auto warm = client_->Call(*inc, *island1, {*x});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(client_->Ready((*warm)[0]).Await().ok());
  const absl::Time start = absl::Now();
  auto y = client_->Call(*inc, *island1, {*x});  // x's shards cross from island 0
  ASSERT_TRUE(y.ok()) << y.status();
  auto got = client_->Fetch((*y)[0]).Await();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GE(absl::Now() - start, kLatency);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got->data<float>()[i], 1.0f);
}

TEST_F(DcnTest, ACollectiveOverBothIslandsWaitsForTheLatency) {
  auto both = client_->CreateSlice({.mesh_shape = {4}, .span_islands = true});
  ASSERT_TRUE(both.ok()) << both.status();
  const TensorSpec spec{DType::kF32, {4}};
  auto sum = client_->Compile(FunctionSpec::Builtin("all_reduce_sum", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(sum.ok()) << sum.status();
  auto x = client_->Put(*HostArray::FromVector<float>(DType::kF32, {4}, {1, 2, 3, 4}), *both, {"x"});
  ASSERT_TRUE(x.ok()) << x.status();
  auto warm = client_->Call(*sum, *both, {*x});
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(client_->Ready((*warm)[0]).Await().ok());
  const absl::Time start = absl::Now();
  auto y = client_->Call(*sum, *both, {*x});
  ASSERT_TRUE(y.ok()) << y.status();
  auto got = client_->Fetch((*y)[0]).Await();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GE(absl::Now() - start, kLatency);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got->data<float>()[i], 10.0f);
}

}  // namespace
}  // namespace pathways
