// Gradients of compiled functions on a slice, checked against the same function written for whole
// arrays and differentiated on one device: the sharded body, its collectives and the replication
// of its inputs and outputs must come out as the global function's vector-Jacobian product.
#include <cmath>

#include "client/client.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"
#include "testing/host_arrays.h"

namespace pathways {
namespace {

using testing::RandomF32;

class GradientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = LocalCluster::Start({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 4,
                                    .device_memory_bytes = 64 << 20})
                   ->release();
  }
  static void TearDownTestSuite() { delete cluster_; }

  void SetUp() override {
    auto client = cluster_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    mesh_ = *client_->CreateSlice({.mesh_shape = {2, 4}});
    one_ = *client_->CreateSlice({.mesh_shape = {1}});
  }

  // The function's outputs, then its inputs' cotangents, computed by its gradient on `slice`
  // from `inputs` and the output cotangents `cotangents`.
  absl::StatusOr<std::vector<HostArray>> ValueAndGradient(const FunctionSpec& primal, const VirtualSlice& slice,
                                                          const std::vector<HostArray>& inputs,
                                                          const std::vector<HostArray>& cotangents) {
    auto spec = FunctionSpec::Vjp(primal, {}, /*with_outputs=*/true);
    if (!spec.ok()) return spec.status();
    auto vjp = client_->Compile(*spec);
    if (!vjp.ok()) return vjp.status();
    std::vector<ShardedArray> args;
    std::vector<HostArray> all = inputs;
    all.insert(all.end(), cotangents.begin(), cotangents.end());
    for (size_t i = 0; i < all.size(); ++i) {
      auto a = client_->Put(all[i], slice, spec->in_shardings[i]);
      if (!a.ok()) return a.status();
      args.push_back(*a);
    }
    auto outs = client_->Call(*vjp, slice, args);
    if (!outs.ok()) return outs.status();
    std::vector<HostArray> fetched;
    for (const ShardedArray& o : *outs) {
      auto h = client_->Fetch(o).Await();
      if (!h.ok()) return h.status();
      fetched.push_back(*h);
    }
    return fetched;
  }

  // Runs the sharded function's gradient on the 2x4 mesh (three times: TorchScript optimises a
  // function after its first runs) and the whole-array one on one device, and compares.
  void ExpectSameGradients(const FunctionSpec& sharded, const FunctionSpec& whole, const std::vector<HostArray>& inputs,
                           const std::vector<HostArray>& cotangents) {
    auto expected = ValueAndGradient(whole, one_, inputs, cotangents);
    ASSERT_TRUE(expected.ok()) << expected.status();
    for (int repeat = 0; repeat < 3; ++repeat) {
      auto got = ValueAndGradient(sharded, mesh_, inputs, cotangents);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), expected->size());
      for (size_t k = 0; k < got->size(); ++k) {
        const HostArray &g = (*got)[k], &e = (*expected)[k];
        ASSERT_EQ(g.shape(), e.shape()) << "result " << k;
        for (int64_t i = 0; i < g.num_elements(); ++i) {
          const float want = e.data<float>()[i];
          ASSERT_NEAR(g.data<float>()[i], want, 1e-4f * (1 + std::fabs(want))) << "result " << k << " element " << i;
        }
      }
    }
  }

  static LocalCluster* cluster_;
  std::unique_ptr<Client> client_;
  VirtualSlice mesh_, one_;
};
LocalCluster* GradientTest::cluster_ = nullptr;

const TensorSpec F32(Shape shape) { return {DType::kF32, std::move(shape)}; }

// Megatron's MLP: the batch split over x, the hidden layer over y; the second matmul's partial
// products meet in an all_reduce. Weights are replicated over x, so their cotangents are summed
// over x too. The loss is replicated over the whole mesh.
TEST_F(GradientTest, TensorParallelMlpAndItsLoss) {
  const std::string sharded_source =
      "def mlp(x, w1, w2):\n"
      "    out = pathways.all_reduce(torch.relu(x @ w1) @ w2, 'y')\n"
      "    return out, pathways.all_reduce((out * out).sum(), 'x')\n";
  const std::string whole_source =
      "def mlp(x, w1, w2):\n"
      "    out = torch.relu(x @ w1) @ w2\n"
      "    return out, (out * out).sum()\n";
  const std::vector<TensorSpec> in = {F32({4, 6}), F32({6, 8}), F32({8, 6})}, out = {F32({4, 6}), F32({})};
  auto sharded = FunctionSpec::Script("mlp", sharded_source, in, out, {{"x", ""}, {"", "y"}, {"y", ""}}, {{"x", ""}, {}});
  auto whole = FunctionSpec::Script("mlp", whole_source, in, out);
  ExpectSameGradients(sharded, whole, {RandomF32({4, 6}, 1), RandomF32({6, 8}, 2), RandomF32({8, 6}, 3)},
                      {RandomF32({4, 6}, 4), RandomF32({}, 5)});
}

// all_gather, reduce_scatter, all_to_all, broadcast and roll, each against what it computes on
// the global array.
TEST_F(GradientTest, CollectivesTransposeToTheirAdjoints) {
  const std::string sharded_source =
      "def moves(x):\n"
      "    g = pathways.all_gather(x, 'y', 0)\n"
      "    rs = pathways.reduce_scatter(g * g, 'y', 'sum', 0)\n"
      "    a2a = pathways.all_to_all(torch.sin(x), 'y', 1)\n"
      "    bc = pathways.broadcast(x * 3.0, 'y', 1)\n"
      "    rl = pathways.roll(torch.cos(x), 'y', 1)\n"
      "    return rs, a2a, bc, rl\n";
  const std::string whole_source =
      "def moves(x):\n"
      "    a2a = torch.sin(x).reshape(4, 2, 4).permute(2, 1, 0).reshape(8, 4)\n"
      "    return 4.0 * x * x, a2a, (x * 3.0)[2:4], torch.roll(torch.cos(x), 2, 0)\n";
  const std::vector<TensorSpec> in = {F32({8, 4})},
                                out = {F32({8, 4}), F32({8, 4}), F32({2, 4}), F32({8, 4})};
  auto sharded = FunctionSpec::Script("moves", sharded_source, in, out, {{"y", ""}},
                                      {{"y", ""}, {"y", ""}, {}, {"y", ""}});
  auto whole = FunctionSpec::Script("moves", whole_source, in, out);
  ExpectSameGradients(sharded, whole, {RandomF32({8, 4}, 6)},
                      {RandomF32({8, 4}, 7), RandomF32({8, 4}, 8), RandomF32({2, 4}, 9), RandomF32({8, 4}, 10)});
}

// Dropout draws the same mask when the forward pass runs again for the gradient, and a mean over
// replicas transposes to a mean.
TEST_F(GradientTest, DropoutAndMeanDifferentiateThroughTheRecomputedForwardPass) {
  const std::string sharded_source =
      "def drop(x):\n"
      "    return pathways.dropout(x, 0.5, ['x', ''], 7, 3) * pathways.all_reduce(x, 'y', 'mean')\n";
  const std::string whole_source =
      "def drop(x):\n"
      "    return pathways.dropout(x, 0.5, ['x', ''], 7, 3) * x\n";
  const std::vector<TensorSpec> in = {F32({4, 6})}, out = {F32({4, 6})};
  auto sharded = FunctionSpec::Script("drop", sharded_source, in, out, {{"x", ""}}, {{"x", ""}});
  auto whole = FunctionSpec::Script("drop", whole_source, in, out);
  ExpectSameGradients(sharded, whole, {RandomF32({4, 6}, 10)}, {RandomF32({4, 6}, 11)});
}

TEST_F(GradientTest, WhatHasNoGradientIsAClearError) {
  auto ints = FunctionSpec::Script("f", "def f(x, n):\n    return x * 2.0\n", {F32({2}), {DType::kI32, {2}}}, {F32({2})});
  auto vjp = FunctionSpec::Vjp(ints, {1});
  ASSERT_FALSE(vjp.ok());
  EXPECT_NE(vjp.status().message().find("input 1, which is i32"), std::string::npos) << vjp.status();
  EXPECT_EQ(FunctionSpec::Vjp(ints, {2}).status().code(), absl::StatusCode::kInvalidArgument);
  auto first = FunctionSpec::Vjp(ints);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->inputs.size(), 3u);  // x, n and the output's cotangent
  EXPECT_EQ(first->outputs.size(), 1u);
  EXPECT_NE(FunctionSpec::Vjp(*first).status().message().find("gradients of gradients"), std::string::npos);

  // fma_loop (a benchmark kernel that writes raw memory) is refused rather than differentiated
  // as the identity.
  auto loop = FunctionSpec::Script("loop", "def loop(x):\n    return pathways.fma_loop(x, 3, 0.5, 0.25)\n",
                                   {F32({4})}, {F32({4})});
  auto refused = ValueAndGradient(loop, one_, {RandomF32({4}, 16)}, {RandomF32({4}, 17)});
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("fma_loop has no gradient"), std::string::npos) << refused.status();

  // all_reduce(max) runs forward but has no gradient: the call fails, naming why, and the
  // devices carry on.
  auto max = FunctionSpec::Script("top", "def top(x):\n    return pathways.all_reduce(x, 'y', 'max')\n", {F32({4})},
                                  {F32({4})}, {{}}, {{}});
  auto result = ValueAndGradient(max, mesh_, {RandomF32({4}, 12)}, {RandomF32({4}, 13)});
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("all_reduce 'max' has no gradient"), std::string::npos) << result.status();
  auto again = ValueAndGradient(FunctionSpec::Script("twice", "def twice(x):\n    return x * 2.0\n", {F32({4})}, {F32({4})}),
                                mesh_, {RandomF32({4}, 14)}, {RandomF32({4}, 15)});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NEAR((*again)[1].data<float>()[0], 2 * RandomF32({4}, 15).data<float>()[0], 1e-6);
}

}  // namespace
}  // namespace pathways
