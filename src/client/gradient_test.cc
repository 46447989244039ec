// Gradients of compiled functions on a slice, checked against the same function written for whole
// arrays and differentiated on one device: the sharded body, its collectives and the replication
// of its inputs and outputs must come out as the global function's vector-Jacobian product.
#include <cmath>

#include "client/client.h"
#include "client/client_test_fixture.h"
#include "gtest/gtest.h"
#include "testing/host_arrays.h"

namespace pathways {
namespace {

using testing::RandomF32;

class GradientTest : public LocalClusterTest {
 protected:
  static void SetUpTestSuite() {
    StartCluster({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 4, .device_memory_bytes = 64 << 20});
  }

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(LocalClusterTest::SetUp());
    mesh_ = *client_->CreateSlice({.mesh_shape = {2, 4}});
    one_ = *client_->CreateSlice({.mesh_shape = {1}});
  }

  absl::StatusOr<std::vector<ShardedArray>> PutAll(const std::vector<HostArray>& arrays, const FunctionSpec& spec,
                                                   size_t first, const VirtualSlice& slice) {
    std::vector<ShardedArray> placed;
    for (size_t i = 0; i < arrays.size(); ++i) {
      auto a = client_->Put(arrays[i], slice, spec.in_shardings[first + i]);
      if (!a.ok()) return a.status();
      placed.push_back(*a);
    }
    return placed;
  }
  absl::StatusOr<std::vector<HostArray>> FetchAll(absl::Span<const ShardedArray> arrays) {
    std::vector<HostArray> fetched;
    for (const ShardedArray& o : arrays) {
      auto h = client_->Fetch(o).Await();
      if (!h.ok()) return h.status();
      fetched.push_back(*h);
    }
    return fetched;
  }

  // The same, in two calls: the forward half keeping its residuals, then the backward half.
  absl::StatusOr<std::vector<HostArray>> SplitValueAndGradient(const FunctionSpec& primal, const VirtualSlice& slice,
                                                               const std::vector<HostArray>& inputs,
                                                               const std::vector<HostArray>& cotangents) {
    auto split = FunctionSpec::VjpKeepingResiduals(primal);
    if (!split.ok()) return split.status();
    auto forward = client_->Compile(split->forward);
    if (!forward.ok()) return forward.status();
    auto backward = client_->Compile(split->backward);
    if (!backward.ok()) return backward.status();
    auto args = PutAll(inputs, split->forward, 0, slice);
    if (!args.ok()) return args.status();
    auto outs = client_->Call(*forward, slice, *args);
    if (!outs.ok()) return outs.status();
    auto cots = PutAll(cotangents, split->backward, 1, slice);
    if (!cots.ok()) return cots.status();
    std::vector<ShardedArray> backward_args = {outs->back()};
    backward_args.insert(backward_args.end(), cots->begin(), cots->end());
    auto grads = client_->Call(*backward, slice, backward_args);
    if (!grads.ok()) return grads.status();
    std::vector<ShardedArray> all(outs->begin(), outs->end() - 1);
    all.insert(all.end(), grads->begin(), grads->end());
    return FetchAll(all);
  }

  // The function's outputs, then its inputs' cotangents, computed by its gradient on `slice`
  // from `inputs` and the output cotangents `cotangents`.
  absl::StatusOr<std::vector<HostArray>> ValueAndGradient(const FunctionSpec& primal, const VirtualSlice& slice,
                                                          const std::vector<HostArray>& inputs,
                                                          const std::vector<HostArray>& cotangents,
                                                          bool split = false) {
    if (split) return SplitValueAndGradient(primal, slice, inputs, cotangents);
    auto spec = FunctionSpec::Vjp(primal, {}, /*with_outputs=*/true);
    if (!spec.ok()) return spec.status();
    auto vjp = client_->Compile(*spec);
    if (!vjp.ok()) return vjp.status();
    std::vector<HostArray> all = inputs;
    all.insert(all.end(), cotangents.begin(), cotangents.end());
    auto args = PutAll(all, *spec, 0, slice);
    if (!args.ok()) return args.status();
    auto outs = client_->Call(*vjp, slice, *args);
    if (!outs.ok()) return outs.status();
    return FetchAll(*outs);
  }

  // Runs the sharded function's gradient on the 2x4 mesh, whole and split (three times each:
  // TorchScript optimises a function after its first runs), and the whole-array one on one
  // device, and compares.
  void ExpectSameGradients(const FunctionSpec& sharded, const FunctionSpec& whole, const std::vector<HostArray>& inputs,
                           const std::vector<HostArray>& cotangents) {
    auto expected = ValueAndGradient(whole, one_, inputs, cotangents);
    ASSERT_TRUE(expected.ok()) << expected.status();
    for (int repeat = 0; repeat < 6; ++repeat) {
      SCOPED_TRACE(repeat % 2 == 0 ? "whole" : "split");
      auto got = ValueAndGradient(sharded, mesh_, inputs, cotangents, /*split=*/repeat % 2 == 1);
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

  VirtualSlice mesh_, one_;
};

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

// A forward half's residuals hold what they saved: an input donated to a later call is copied
// for it, so the backward half still sees the values its forward pass saw. A handle fetched and
// put back, or moved to another slice, has no residuals there, and the backward half says so.
TEST_F(GradientTest, KeptResidualsSurviveDonationAndStayOnTheirDevices) {
  auto primal = FunctionSpec::Script("scale", "def scale(x, w):\n    return torch.tanh(x * w)\n", {F32({8}), F32({8})},
                                     {F32({8})}, {{"y"}, {"y"}}, {{"y"}});
  auto split = FunctionSpec::VjpKeepingResiduals(primal, {0});  // x's cotangent reads the w saved
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->forward.outputs.size(), 2u);
  EXPECT_EQ(split->forward.outputs[1].dtype, DType::kI64);
  EXPECT_EQ(split->backward.inputs.size(), 2u);  // the handle and the output's cotangent
  auto forward = client_->Compile(split->forward);
  auto backward = client_->Compile(split->backward);
  ASSERT_TRUE(forward.ok() && backward.ok()) << forward.status() << backward.status();
  const HostArray x = RandomF32({8}, 20), w = RandomF32({8}, 21), dy = RandomF32({8}, 22);
  auto args = PutAll({x, w}, split->forward, 0, mesh_);
  ASSERT_TRUE(args.ok()) << args.status();
  auto outs = client_->Call(*forward, mesh_, *args);
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto kept = client_->Fetch((*outs)[1]).Await();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_GT(kept->data<int64_t>()[0], 0);  // bytes held on each device

  // w is donated to a call that zeroes it in place.
  auto zero = FunctionSpec::Script("zero", "def zero(w):\n    return w.zero_()\n", {F32({8})}, {F32({8})}, {{"y"}},
                                   {{"y"}});
  zero.donated_inputs = {0};
  auto zeroing = client_->Compile(zero);
  ASSERT_TRUE(zeroing.ok()) << zeroing.status();
  auto zeroed = client_->Call(*zeroing, mesh_, {(*args)[1]});
  ASSERT_TRUE(zeroed.ok()) << zeroed.status();
  auto zeros = client_->Fetch((*zeroed)[0]).Await();
  ASSERT_TRUE(zeros.ok()) << zeros.status();
  EXPECT_EQ(zeros->data<float>()[3], 0.0f);

  auto cot = client_->Put(dy, mesh_, split->backward.in_shardings[1]);
  ASSERT_TRUE(cot.ok()) << cot.status();
  auto grads = client_->Call(*backward, mesh_, {(*outs)[1], *cot});
  ASSERT_TRUE(grads.ok()) << grads.status();
  auto dx = client_->Fetch((*grads)[0]).Await();
  ASSERT_TRUE(dx.ok()) << dx.status();
  for (int i = 0; i < 8; ++i) {
    const float wi = w.data<float>()[i], t = std::tanh(x.data<float>()[i] * wi);
    EXPECT_NEAR(dx->data<float>()[i], dy.data<float>()[i] * (1 - t * t) * wi, 1e-5) << i;
  }

  auto put_back = client_->Put(*kept, mesh_);
  ASSERT_TRUE(put_back.ok()) << put_back.status();
  auto none = client_->Call(*backward, mesh_, {*put_back, *cot});
  ASSERT_TRUE(none.ok()) << none.status();
  absl::Status s = client_->Ready((*none)[0]).Await().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("carries no residuals on this device"), std::string::npos) << s;
  // The same devices as another mesh: the handle reaches them as it is, but the graph belongs to
  // the forward call's gang (its collectives' groups), so the backward half refuses it.
  auto other_mesh = client_->CreateSlice({.mesh_shape = {4, 2}});
  ASSERT_TRUE(other_mesh.ok()) << other_mesh.status();
  auto other_cot = client_->Put(dy, *other_mesh, split->backward.in_shardings[1]);
  ASSERT_TRUE(other_cot.ok()) << other_cot.status();
  auto elsewhere = client_->Call(*backward, *other_mesh, {(*outs)[1], *other_cot});
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  s = client_->Ready((*elsewhere)[0]).Await().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("on another slice or mesh"), std::string::npos) << s;

  // The forward half cannot take a donated input's buffer: its graph views its inputs.
  FunctionSpec donating = split->forward;
  donating.donated_inputs = {0};
  EXPECT_EQ(client_->Compile(donating).status().code(), absl::StatusCode::kInvalidArgument);

  // The devices carry on: the kept handle still works.
  auto again = client_->Call(*backward, mesh_, {(*outs)[1], *cot});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(client_->Ready((*again)[0]).Await().ok());

  // Donated to another call, the handle's buffer holds that call's output, not the graph.
  auto bump = FunctionSpec::Script("bump", "def bump(h):\n    return h + 0\n", {{DType::kI64, {}}},
                                   {{DType::kI64, {}}});
  bump.donated_inputs = {0};
  auto bumping = client_->Compile(bump);
  ASSERT_TRUE(bumping.ok()) << bumping.status();
  auto bumped = client_->Call(*bumping, mesh_, {(*outs)[1]});
  ASSERT_TRUE(bumped.ok()) << bumped.status();
  auto after = client_->Call(*backward, mesh_, {(*bumped)[0], *cot});
  ASSERT_TRUE(after.ok()) << after.status();
  s = client_->Ready((*after)[0]).Await().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("carries no residuals on this device"), std::string::npos) << s;
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
