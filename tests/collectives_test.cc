// Every collective, from TorchScript and from built-in kernels, on 1-D and 2-D meshes, within one
// host and across hosts, checked against libtorch applied to the gathered shards.
// ivalue.h first: with clang 14, torch/torch.h alone uses c10::IValue before defining it.
#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <functional>

#include "client/client.h"
#include "cluster/local_cluster.h"
#include "collective/collective.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

using Group = std::vector<at::Tensor>;

struct Case {
  std::string name;
  std::string script;   // TorchScript expression of x
  std::string builtin;  // built-in kernel, or "" when there is none
  // libtorch on the group's shards: what the member of rank `rank` gets.
  std::function<at::Tensor(const Group&, int rank)> reference;
};

at::Tensor Chunk(const at::Tensor& t, int rank, size_t n) {
  const int64_t c = t.size(0) / static_cast<int64_t>(n);
  return t.narrow(0, rank * c, c);
}

std::vector<Case> Cases() {
  auto stack = [](const Group& g) { return torch::stack(g); };
  return {
      {"sum", "pathways.all_reduce(x, AXES)", "all_reduce_sum", [=](const Group& g, int) { return stack(g).sum(0); }},
      {"max", "pathways.all_reduce(x, AXES, 'max')", "all_reduce_max",
       [=](const Group& g, int) { return stack(g).amax(0); }},
      {"min", "pathways.all_reduce(x, AXES, 'min')", "all_reduce_min",
       [=](const Group& g, int) { return stack(g).amin(0); }},
      {"mean", "pathways.all_reduce(x, AXES, 'mean')", "all_reduce_mean",
       [=](const Group& g, int) { return stack(g).mean(0); }},
      // Of a temporary, which the reduction overwrites in place.
      {"sum_of_temporary", "pathways.all_reduce(x * 2.0, AXES)", "",
       [=](const Group& g, int) { return stack(g).sum(0) * 2.0; }},
      {"mean_of_temporary", "pathways.all_reduce(x + 0.5, AXES, 'mean')", "",
       [=](const Group& g, int) { return stack(g).mean(0) + 0.5; }},
      {"all_gather", "pathways.all_gather(x, AXES)", "all_gather", [](const Group& g, int) { return torch::cat(g, 0); }},
      {"all_gather_dim1", "pathways.all_gather(x, AXES, 1)", "", [](const Group& g, int) { return torch::cat(g, 1); }},
      {"reduce_scatter", "pathways.reduce_scatter(x, AXES)", "reduce_scatter_sum",
       [=](const Group& g, int rank) { return Chunk(stack(g).sum(0), rank, g.size()); }},
      {"all_to_all", "pathways.all_to_all(x, AXES)", "all_to_all",
       [](const Group& g, int rank) {
         Group mine;
         for (const at::Tensor& t : g) mine.push_back(Chunk(t, rank, g.size()));
         return torch::cat(mine, 0);
       }},
      {"broadcast", "pathways.broadcast(x, AXES, 1)", "",
       [](const Group& g, int) { return g[std::min<size_t>(1, g.size() - 1)]; }},
      {"broadcast_root0", "pathways.broadcast(x, AXES)", "broadcast", [](const Group& g, int) { return g[0]; }},
      // Point to point: member r gets member (r - shift)'s input.
      {"roll", "pathways.roll(x, AXES, 1)", "",
       [](const Group& g, int rank) { return g[static_cast<size_t>((rank + g.size() - 1) % g.size())]; }},
      {"roll_back_three", "pathways.roll(x, AXES, -3)", "",
       [](const Group& g, int rank) { return g[static_cast<size_t>((rank + 3) % g.size())]; }},
      // Not a collective: each shard's position in its group.
      {"axis_index", "x * 0.0 + pathways.axis_index(AXES)", "",
       [](const Group& g, int rank) { return torch::full_like(g[static_cast<size_t>(rank)], rank); }},
      // Collectives that only move data take element types the runtime cannot reduce.
      {"all_gather_half", "pathways.all_gather(x.half(), AXES).float()", "",
       [](const Group& g, int) { return torch::cat(g, 0).to(torch::kHalf).to(torch::kFloat); }},
      {"all_to_all_int8", "pathways.all_to_all(x.char(), AXES).float()", "",
       [](const Group& g, int rank) {
         Group mine;
         for (const at::Tensor& t : g) mine.push_back(Chunk(t, rank, g.size()).to(torch::kInt8));
         return torch::cat(mine, 0).to(torch::kFloat);
       }},
  };
}

at::Tensor ToTensor(const HostArray& a) {
  return torch::from_blob(const_cast<char*>(a.bytes().data()), a.shape(), torch::kFloat).clone();
}

HostArray FromTensor(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return *HostArray::FromBytes(DType::kF32, Shape(c.sizes().begin(), c.sizes().end()),
                               std::string(static_cast<const char*>(c.data_ptr()), c.nbytes()));
}

struct Layout {
  std::vector<int64_t> mesh;
  std::vector<std::string> names;
};

class CollectivesTest : public ::testing::TestWithParam<int /*hosts*/> {
 protected:
  static constexpr int64_t kRows = 4, kCols = 3;  // every shard's block

  void SetUp() override {
    const int hosts = GetParam();
    auto cluster = LocalCluster::Start({1, hosts, 4 / hosts, int64_t{64} << 20});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    client_ = *cluster_->Connect();
  }

  // Runs `body_expr` over `axes` of a slice with `layout` and checks every shard's result.
  void Check(const Layout& layout, const std::string& axes, const Case& c, bool builtin) {
    SCOPED_TRACE(absl::StrCat(c.name, builtin ? " (built-in)" : " (TorchScript)", " over '", axes, "' of ",
                              layout.mesh.size(), "-D mesh"));
    auto slice = client_->CreateSlice({layout.mesh, layout.names});
    ASSERT_TRUE(slice.ok()) << slice.status();
    ASSERT_EQ(static_cast<int>(slice->host_addresses().size()), GetParam());
    const int64_t mx = layout.mesh[0], my = layout.mesh.size() > 1 ? layout.mesh[1] : 1;
    const PartitionSpec split = layout.mesh.size() > 1 ? PartitionSpec{"x", "y"} : PartitionSpec{"x", ""};
    torch::manual_seed(7);
    at::Tensor global = torch::randn({mx * kRows, my * kCols});
    auto block = [&](const at::Tensor& t, int64_t shard, int64_t rows, int64_t cols) {
      return t.narrow(0, (shard / my) * rows, rows).narrow(1, (shard % my) * cols, cols);
    };
    // The reference result of every shard, and the local output shape they share.
    collective::GangLayout gang{layout.mesh, layout.names, std::vector<collective::Member>(mx * my)};
    std::vector<at::Tensor> expected;
    for (int64_t s = 0; s < mx * my; ++s) {
      auto group = collective::GroupOf(gang, s, axes);
      ASSERT_TRUE(group.ok()) << group.status();
      Group shards;
      for (int64_t m : group->shards) shards.push_back(block(global, m, kRows, kCols));
      expected.push_back(c.reference(shards, group->rank).contiguous());
    }
    const int64_t out_rows = expected[0].size(0), out_cols = expected[0].size(1);
    at::Tensor want = torch::empty({mx * out_rows, my * out_cols});
    for (int64_t s = 0; s < mx * my; ++s) block(want, s, out_rows, out_cols).copy_(expected[s]);

    const std::vector<TensorSpec> in{{DType::kF32, {mx * kRows, my * kCols}}};
    const std::vector<TensorSpec> out{{DType::kF32, {mx * out_rows, my * out_cols}}};
    FunctionSpec spec =
        builtin ? FunctionSpec::Builtin(absl::StrCat(c.builtin, "@", axes), in, out, {split}, {split})
                : FunctionSpec::Script("f",
                                       absl::StrCat("def f(x):\n    return ",
                                                    absl::StrReplaceAll(c.script, {{"AXES", absl::StrCat("'", axes, "'")}}),
                                                    "\n"),
                                       in, out, {split}, {split});
    auto fn = client_->Compile(spec);
    ASSERT_TRUE(fn.ok()) << fn.status();
    auto x = client_->Put(FromTensor(global), *slice, split);
    ASSERT_TRUE(x.ok()) << x.status();
    auto result = client_->Call(*fn, *slice, {*x});
    ASSERT_TRUE(result.ok()) << result.status();
    auto fetched = client_->Fetch((*result)[0]).Await();
    ASSERT_TRUE(fetched.ok()) << fetched.status();
    EXPECT_TRUE(torch::allclose(ToTensor(*fetched), want, 1e-5, 1e-5))
        << "got\n" << ToTensor(*fetched) << "\nwant\n" << want;
    // The input is the caller's still: no collective wrote over it.
    auto input = client_->Fetch(*x).Await();
    ASSERT_TRUE(input.ok()) << input.status();
    EXPECT_TRUE(torch::equal(ToTensor(*input), global));
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Client> client_;
};

TEST_P(CollectivesTest, EveryCollectiveOnA1DMesh) {
  for (const Case& c : Cases()) {
    Check({{4}, {"x"}}, "x", c, false);
    if (!c.builtin.empty()) Check({{4}, {"x"}}, "x", c, true);
  }
}

TEST_P(CollectivesTest, EveryCollectiveOverEachAxisOfA2DMesh) {
  for (const std::string axes : {"x", "y", "x,y", "y,x"}) {
    for (const Case& c : Cases()) {
      Check({{2, 2}, {"x", "y"}}, axes, c, false);
      if (!c.builtin.empty() && axes == "y") Check({{2, 2}, {"x", "y"}}, axes, c, true);
    }
  }
}

TEST_P(CollectivesTest, BadCollectiveArgumentsFailTheRunWithTheirReason) {
  auto slice = *client_->CreateSlice({{4}, {"x"}});
  const std::vector<TensorSpec> io{{DType::kF32, {16, 3}}};
  auto x = *client_->Put(FromTensor(torch::ones({16, 3})), slice, {"x", ""});
  struct Bad {
    std::string body;
    std::string message;
  };
  for (const Bad& bad : std::vector<Bad>{{"pathways.all_reduce(x, 'nope')", "unknown mesh axis 'nope'"},
                                         {"pathways.all_reduce(x, 'x', 'median')", "unknown reduction 'median'"},
                                         {"pathways.broadcast(x, 'x', 9)", "root 9"},
                                         {"pathways.all_to_all(x[:3], 'x')", "does not split into 4"},
                                         {"pathways.roll(x, 'nope', 1)", "unknown mesh axis 'nope'"},
                                         {"x * pathways.axis_index('nope')", "unknown mesh axis 'nope'"}}) {
    auto fn = client_->Compile(FunctionSpec::Script("f", absl::StrCat("def f(x):\n    return ", bad.body, "\n"), io,
                                                    io, {{"x", ""}}, {{"x", ""}}));
    ASSERT_TRUE(fn.ok()) << fn.status();
    auto r = client_->Call(*fn, slice, {x});
    ASSERT_TRUE(r.ok()) << r.status();
    auto fetched = client_->Fetch((*r)[0]).Await();
    EXPECT_TRUE(absl::IsInvalidArgument(fetched.status())) << bad.body << ": " << fetched.status();
    EXPECT_NE(fetched.status().message().find(bad.message), std::string::npos) << fetched.status();
  }
  // The devices keep serving.
  auto sum = *client_->Compile(FunctionSpec::Builtin("all_reduce_sum@x", io, io, {{"x", ""}}, {{"x", ""}}));
  auto fetched = client_->Fetch((*client_->Call(sum, slice, {x}))[0]).Await();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_TRUE(torch::allclose(ToTensor(*fetched), torch::full({16, 3}, 4.0f)));
}

// Members that disagree on the shape: one shard's contribution is twice the others'. Every run
// fails with the cause, whichever shard's error the client sees (over four hosts the collectives
// take several rounds, and most hosts learn of the mismatch from a peer), and well before the
// collective timeout.
TEST_P(CollectivesTest, MembersThatDisagreeOnTheShapeFailWithTheCauseEveryTime) {
  auto slice = *client_->CreateSlice({{4}, {"x"}});
  const std::vector<TensorSpec> io{{DType::kF32, {16, 3}}};
  auto x = *client_->Put(FromTensor(torch::ones({16, 3})), slice, {"x", ""});
  for (const std::string call : {"all_gather(y, 'x')", "all_to_all(y, 'x')", "broadcast(y, 'x', 0)"}) {
    auto fn = client_->Compile(FunctionSpec::Script("f",
                                                    absl::StrCat("def f(x):\n"
                                                                 "    y = x\n"
                                                                 "    if pathways.axis_index('x') == 1:\n"
                                                                 "        y = torch.cat([x, x])\n"
                                                                 "    return pathways.",
                                                                 call, "[0:4]\n"),
                                                    io, io, {{"x", ""}}, {{"x", ""}}));
    ASSERT_TRUE(fn.ok()) << fn.status();
    for (int run = 0; run < 4; ++run) {
      const absl::Time start = absl::Now();
      auto r = client_->Call(*fn, slice, {x});
      ASSERT_TRUE(r.ok()) << r.status();
      auto fetched = client_->Fetch((*r)[0]).Await();
      EXPECT_TRUE(absl::IsInvalidArgument(fetched.status())) << call << ": " << fetched.status();
      EXPECT_NE(fetched.status().message().find("disagree"), std::string::npos) << call << ": " << fetched.status();
      EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << call << ": found by size, not by a timeout";
    }
  }
  auto sum = *client_->Compile(FunctionSpec::Builtin("all_reduce_sum@x", io, io, {{"x", ""}}, {{"x", ""}}));
  auto fetched = client_->Fetch((*client_->Call(sum, slice, {x}))[0]).Await();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_TRUE(torch::allclose(ToTensor(*fetched), torch::full({16, 3}, 4.0f)));
}

// A shard whose input failed (here the run before failed on shard 1 alone) makes no collective
// call; its group mates, on its host and (told by them, or, where shard 1 is its host's only
// member, by asking that host) on others, fail at once naming it, not at the collective timeout,
// and the devices serve the next run (CollectiveHub::Withdraw).
TEST_P(CollectivesTest, AMemberWhoseInputFailedDoesNotHoldItsMates) {
  auto slice = *client_->CreateSlice({{4}, {"x"}});
  const std::vector<TensorSpec> io{{DType::kF32, {16, 3}}};
  auto x = *client_->Put(FromTensor(torch::ones({16, 3})), slice, {"x", ""});
  auto fails_on_one = *client_->Compile(FunctionSpec::Script("fails_on_one",
                                                             "def fails_on_one(x):\n"
                                                             "    if pathways.axis_index('x') == 1:\n"
                                                             "        x = pathways.all_reduce(x, 'shard_one_fails')\n"
                                                             "    return x + 1.0\n",
                                                             io, io, {{"x", ""}}, {{"x", ""}}));
  auto sum = *client_->Compile(FunctionSpec::Builtin("all_reduce_sum@x", io, io, {{"x", ""}}, {{"x", ""}}));
  for (int run = 0; run < 3; ++run) {
    const absl::Time start = absl::Now();
    auto failed = *client_->Call(fails_on_one, slice, {x});
    auto fetched = client_->Fetch((*client_->Call(sum, slice, {failed[0]}))[0]).Await();
    EXPECT_FALSE(fetched.ok());
    EXPECT_NE(fetched.status().message().find("unknown mesh axis 'shard_one_fails'"), std::string::npos)
        << fetched.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << fetched.status();
  }
  auto good = client_->Fetch((*client_->Call(sum, slice, {x}))[0]).Await();
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(torch::allclose(ToTensor(*good), torch::full({16, 3}, 4.0f)));
}

// An all_reduce of a value the body no longer needs reduces it where it is: the device holds the
// temporary, the output buffer and nothing more, while a value still in use (here a view of it
// is returned too) is reduced into a fresh buffer and keeps its value.
TEST_P(CollectivesTest, AnAllReduceOfATemporaryReducesInPlace) {
  auto slice = client_->CreateSlice({{4}, {"x"}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  constexpr int64_t kElements = 256 << 10;  // 1 MiB per shard
  const TensorSpec spec{DType::kF32, {4 * kElements}};
  auto in_place = client_->Compile(FunctionSpec::Script(
      "temporary", "def temporary(x):\n    return pathways.all_reduce(x * 2.0, 'x')\n", {spec}, {spec}, {{"x"}},
      {{"x"}}));
  auto kept = client_->Compile(FunctionSpec::Script(
      "kept", "def kept(x):\n    y = x * 2.0\n    return pathways.all_reduce(y, 'x'), y[0:4]\n", {spec},
      {spec, {DType::kF32, {16}}}, {{"x"}}, {{"x"}, {"x"}}));
  ASSERT_TRUE(in_place.ok() && kept.ok()) << in_place.status() << kept.status();
  at::Tensor global = torch::arange(4 * kElements, torch::kFloat);
  auto x = client_->Put(FromTensor(global), *slice, {"x"});
  ASSERT_TRUE(x.ok() && client_->Ready(*x).Await().ok());
  Device& device = cluster_->worker(0).runtime().device(0);
  const int64_t before = device.stats().memory_used;  // x's shard
  auto peak_of = [&](const CompiledFunction& fn, std::vector<HostArray>* fetched) {
    int64_t peak = 0;
    // The last call's outputs are freed once their handles go, in the background.
    EXPECT_TRUE(device.WaitForMemoryUsedAtMost(before, absl::Seconds(30)));
    device.ResetMemoryPeak();
    auto out = client_->Call(fn, *slice, {*x});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return peak;
    for (const ShardedArray& a : *out) {
      auto f = client_->Fetch(a).Await();
      EXPECT_TRUE(f.ok()) << f.status();
      if (f.ok()) fetched->push_back(*f);
    }
    peak = device.stats().memory_peak - before;
    return peak;
  };
  const at::Tensor sum = (global * 2.0).view({4, kElements}).sum(0).repeat(4);
  std::vector<HostArray> got;
  const int64_t temporary_peak = peak_of(*in_place, &got);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(torch::equal(ToTensor(got[0]), sum));
  constexpr int64_t kShardBytes = kElements * 4;
  // (Besides a few bytes of scalars.)
  EXPECT_GE(temporary_peak, 2 * kShardBytes);
  EXPECT_LT(temporary_peak, 2 * kShardBytes + 4096) << "the temporary and the output buffer only";
  got.clear();
  const int64_t kept_peak = peak_of(*kept, &got);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(torch::equal(ToTensor(got[0]), sum));
  at::Tensor firsts = torch::empty({16});
  for (int s = 0; s < 4; ++s) firsts.narrow(0, 4 * s, 4).copy_(global.narrow(0, s * kElements, 4) * 2.0);
  EXPECT_TRUE(torch::equal(ToTensor(got[1]), firsts)) << ToTensor(got[1]);
  EXPECT_GE(kept_peak, 3 * kShardBytes) << "y, the reduction's own buffer and the output";
}

// Four hosts of one device: over all four, small all_gather, broadcast and all_to_all take
// log2(H) rounds (Bruck's, a binomial tree) instead of one round of direct sends.
INSTANTIATE_TEST_SUITE_P(Hosts, CollectivesTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 1   ? std::string("OneHost")
                                  : info.param == 2 ? std::string("TwoHosts")
                                                    : std::string("FourHosts");
                         });

}  // namespace
}  // namespace pathways
