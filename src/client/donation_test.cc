// Donating inputs to calls: the output takes the input's buffer (updated in place), the caller's
// handle is spent, and a device holds one copy of what an update step rewrites, not two.
#include <thread>

#include "client/client.h"
#include "client/client_test_fixture.h"
#include "client/program.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

HostArray Filled(Shape shape, float start) {
  HostArray a = *HostArray::Create(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < a.num_elements(); ++i) a.mutable_data<float>()[i] = start + static_cast<float>(i % 7);
  return a;
}

constexpr int64_t kMiB = 1 << 20;

class DonationTest : public LocalClusterTest {
 protected:
  static void SetUpTestSuite() {
    // Devices of 24 MiB: an update of a 16 MiB array fits only in place.
    StartCluster({.num_islands = 1,
                  .hosts_per_island = 1,
                  .devices_per_host = 2,
                  .device_memory_bytes = 24 * kMiB,
                  .memory_wait = absl::Seconds(1)});
  }

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(LocalClusterTest::SetUp());
    slice_ = *client_->CreateSlice({.mesh_shape = {2}});
  }

  // p <- p - g / 2, in place; donating p when `donate`.
  CompiledFunction Step(int64_t n, bool donate) {
    FunctionSpec spec = FunctionSpec::Script("step", "def step(p, g):\n    return p.sub_(g * 0.5)\n",
                                             {{DType::kF32, {n}}, {DType::kF32, {n}}}, {{DType::kF32, {n}}},
                                             {{"x"}, {"x"}}, {{"x"}});
    if (donate) spec.donated_inputs = {0};
    auto fn = client_->Compile(spec);
    EXPECT_TRUE(fn.ok()) << fn.status();
    return *fn;
  }

  VirtualSlice slice_;
};

TEST_F(DonationTest, TheOutputTakesTheInputAndTheHandleIsSpent) {
  const int64_t n = 8;
  CompiledFunction step = Step(n, true);
  ShardedArray p = *client_->Put(Filled({n}, 1), slice_, {"x"});
  ShardedArray g = *client_->Put(Filled({n}, 2), slice_, {"x"});
  auto out = client_->Call(step, slice_, {p, g});
  ASSERT_TRUE(out.ok()) << out.status();
  auto value = client_->Fetch((*out)[0]).Await();
  ASSERT_TRUE(value.ok()) << value.status();
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(value->data<float>()[i], 1 + i % 7 - (2 + i % 7) * 0.5f);

  auto spent = client_->Fetch(p).Await();
  EXPECT_EQ(spent.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(spent.status().message().find("donated"), std::string::npos) << spent.status();
  auto again = client_->Call(step, slice_, {p, g});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("donated to an earlier call"), std::string::npos) << again.status();
  // Given twice, once at a donated position: refused before anything is spent.
  ShardedArray q = (*out)[0];
  auto twice = client_->Call(step, slice_, {q, q});
  EXPECT_NE(twice.status().message().find("again at 1"), std::string::npos) << twice.status();
  EXPECT_TRUE(client_->Fetch(q).Await().ok());
  // g was not donated and is unchanged.
  auto g_value = client_->Fetch(g).Await();
  ASSERT_TRUE(g_value.ok());
  EXPECT_EQ(g_value->data<float>()[3], 5);
}

TEST_F(DonationTest, AnUpdateOfMoreThanHalfTheDeviceFitsOnlyInPlace) {
  const int64_t n = 2 * 16 * kMiB / 4;  // 16 MiB per device
  auto halve = [&](bool donate) {
    FunctionSpec spec = FunctionSpec::Script("halve", "def halve(p):\n    return p.mul_(0.5)\n", {{DType::kF32, {n}}},
                                             {{DType::kF32, {n}}}, {{"x"}}, {{"x"}});
    if (donate) spec.donated_inputs = {0};
    return *client_->Compile(spec);
  };
  HostArray p_host = Filled({n}, 1);
  // Without donation the step needs a second 16 MiB buffer on a 24 MiB device: it cannot run.
  {
    ShardedArray p = *client_->Put(p_host, slice_, {"x"});
    auto out = client_->Call(halve(false), slice_, {p});
    ASSERT_TRUE(out.ok()) << out.status();
    auto failed = client_->Fetch((*out)[0]).Await();
    EXPECT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  }
  ShardedArray p = *client_->Put(p_host, slice_, {"x"});
  CompiledFunction in_place = halve(true);
  for (int i = 0; i < 5; ++i) {
    auto out = client_->Call(in_place, slice_, {p});
    ASSERT_TRUE(out.ok()) << out.status();
    p = (*out)[0];
  }
  auto value = client_->Fetch(p).Await();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_FLOAT_EQ(value->data<float>()[n - 1], p_host.data<float>()[n - 1] / 32);
}

TEST_F(DonationTest, AFetchBeforeTheDonationSeesTheValueBefore) {
  const int64_t n = 1024;
  CompiledFunction step = Step(n, true);
  ShardedArray g = *client_->Put(Filled({n}, 2), slice_, {"x"});
  for (int round = 0; round < 20; ++round) {
    ShardedArray p = *client_->Put(Filled({n}, static_cast<float>(round)), slice_, {"x"});
    Future<HostArray> before = client_->Fetch(p);
    auto out = client_->Call(step, slice_, {p, g});
    ASSERT_TRUE(out.ok()) << out.status();
    const auto& old = before.Await();
    ASSERT_TRUE(old.ok()) << old.status();
    EXPECT_EQ(old->data<float>()[5], round + 5) << round;
  }
}

TEST_F(DonationTest, ProgramsDonateArgumentsAndIntermediates) {
  const int64_t n = 16;
  CompiledFunction step = Step(n, true);
  auto add = client_->Compile(FunctionSpec::Builtin("add", {{DType::kF32, {n}}, {DType::kF32, {n}}}, {{DType::kF32, {n}}},
                                                    {{"x"}, {"x"}}, {{"x"}}));
  ASSERT_TRUE(add.ok());
  const TensorSpec spec{DType::kF32, {n}};
  // p' = step(step(p, g), g) with both steps in place: the second takes the first's output.
  ProgramBuilder b("two_steps");
  TracedValue p = b.Arg(spec), g = b.Arg(spec);
  auto s1 = b.Call(step, slice_, {p, g});
  ASSERT_TRUE(s1.ok()) << s1.status();
  auto s2 = b.Call(step, slice_, {(*s1)[0], g});
  ASSERT_TRUE(s2.ok()) << s2.status();
  // What may not be traced: a donated value used again, or returned; a donated value used before.
  EXPECT_NE(b.Call(*add, slice_, {p, g}).status().message().find("was donated to call 0"), std::string::npos);
  EXPECT_NE(b.Call(*add, slice_, {(*s1)[0], g}).status().message().find("was donated to call 1"), std::string::npos);
  ProgramBuilder reuse("reuse");
  TracedValue r = reuse.Arg(spec);
  ASSERT_TRUE(reuse.Call(*add, slice_, {r, r}).ok());  // read before it is donated: fine
  EXPECT_NE(reuse.Call(step, slice_, {r, r}).status().message().find("at another input too"), std::string::npos);
  Program program = *b.Build({(*s2)[0]});
  EXPECT_EQ(program.donated_args(), std::vector<int>{0});
  EXPECT_NE(program.ToString().find("[donates 0]"), std::string::npos) << program.ToString();

  ShardedArray params = *client_->Put(Filled({n}, 10), slice_, {"x"});
  ShardedArray grads = *client_->Put(Filled({n}, 2), slice_, {"x"});
  for (int i = 0; i < 3; ++i) {
    auto out = client_->Run(program, {params, grads});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(client_->Run(program, {params, grads}).status().code(), absl::StatusCode::kInvalidArgument);
    params = (*out)[0];
  }
  auto value = client_->Fetch(params).Await();
  ASSERT_TRUE(value.ok()) << value.status();
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(value->data<float>()[i], 10 + i % 7 - 6 * 0.5f * (2 + i % 7)) << i;
}

TEST_F(DonationTest, DonatingAValueTheStoreStillHoldsGivesTheSameResult) {
  // The output of a data-dependent call stays in the store until the run ends (the client waits
  // on it): the step that takes it at a donated position gets a copy, with the same result.
  const int64_t n = 16;
  FunctionSpec produce = FunctionSpec::Builtin("add_one", {{DType::kF32, {n}}}, {{DType::kF32, {n}}}, {{"x"}}, {{"x"}});
  produce.data_dependent_shapes = true;
  auto first = client_->Compile(produce);
  ASSERT_TRUE(first.ok());
  CompiledFunction step = Step(n, true);
  const TensorSpec spec{DType::kF32, {n}};
  ProgramBuilder b("copied");
  TracedValue p = b.Arg(spec), g = b.Arg(spec);
  auto made = b.Call(*first, slice_, {p});
  auto stepped = b.Call(step, slice_, {(*made)[0], g});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  Program program = *b.Build({(*stepped)[0]});
  auto out = client_->Run(program, {*client_->Put(Filled({n}, 0), slice_, {"x"}), *client_->Put(Filled({n}, 4), slice_, {"x"})});
  ASSERT_TRUE(out.ok()) << out.status();
  auto value = client_->Fetch((*out)[0]).Await();
  ASSERT_TRUE(value.ok()) << value.status();
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(value->data<float>()[i], 1 + i % 7 - 0.5f * (4 + i % 7)) << i;
}

TEST_F(DonationTest, CallsBeforeTheDonatingOneReadTheValueBefore) {
  // A reader on a slice of its own (it may share a device with the step, or not), then the step
  // that updates its input in place: whichever runs first, the reader sees the value before.
  const int64_t n = 64;
  CompiledFunction step = Step(n, true);
  VirtualSlice one = *client_->CreateSlice({.mesh_shape = {1}});
  auto total = client_->Compile(FunctionSpec::Builtin("sum", {{DType::kF32, {n}}}, {{DType::kF32, {}}}));
  ASSERT_TRUE(total.ok());
  const TensorSpec spec{DType::kF32, {n}};
  ProgramBuilder b("read_then_step");
  TracedValue p = b.Arg(spec), g = b.Arg(spec);
  auto read = b.Call(*total, one, {p});
  auto stepped = b.Call(step, slice_, {p, g});
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  Program program = *b.Build({(*read)[0], (*stepped)[0]});
  HostArray p_host = Filled({n}, 1);
  float expected = 0;
  for (int64_t i = 0; i < n; ++i) expected += p_host.data<float>()[i];
  ShardedArray g_arr = *client_->Put(Filled({n}, 2), slice_, {"x"});
  for (int round = 0; round < 20; ++round) {
    auto out = client_->Run(program, {*client_->Put(p_host, slice_, {"x"}), g_arr});
    ASSERT_TRUE(out.ok()) << out.status();
    auto sum = client_->Fetch((*out)[0]).Await();
    ASSERT_TRUE(sum.ok()) << sum.status();
    EXPECT_EQ(sum->data<float>()[0], expected) << round;
    auto value = client_->Fetch((*out)[1]).Await();
    ASSERT_TRUE(value.ok()) << value.status();
    EXPECT_FLOAT_EQ(value->data<float>()[9], 1 + 9 % 7 - 0.5f * (2 + 9 % 7)) << round;
  }
}

TEST_F(DonationTest, OfThreadsDonatingOneArrayAtOnceExactlyOneDoes) {
  const int64_t n = 8;
  CompiledFunction step = Step(n, true);
  ShardedArray g = *client_->Put(Filled({n}, 2), slice_, {"x"});
  for (int round = 0; round < 10; ++round) {
    ShardedArray p = *client_->Put(Filled({n}, 1), slice_, {"x"});
    std::vector<absl::StatusOr<std::vector<ShardedArray>>> results(4, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { results[t] = client_->Call(step, slice_, {p, g}); });
    for (auto& t : threads) t.join();
    int succeeded = 0;
    for (const auto& r : results) {
      if (r.ok()) {
        ++succeeded;
        EXPECT_TRUE(client_->Fetch((*r)[0]).Await().ok());
      } else {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      }
    }
    EXPECT_EQ(succeeded, 1) << round;
  }
}

TEST_F(DonationTest, BadDonationsAreRefusedAtCompile) {
  FunctionSpec spec = FunctionSpec::Builtin("add", {{DType::kF32, {4}}, {DType::kF32, {2}}}, {{DType::kF32, {4}}});
  spec.donated_inputs = {1};
  EXPECT_NE(client_->Compile(spec).status().message().find("no output has its spec and sharding"), std::string::npos);
  spec.donated_inputs = {2};
  EXPECT_EQ(client_->Compile(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.donated_inputs = {0, 0};
  EXPECT_NE(client_->Compile(spec).status().message().find("twice"), std::string::npos);
  FunctionSpec layout = FunctionSpec::Builtin("identity", {{DType::kF32, {4}}}, {{DType::kF32, {4}}}, {{"x"}}, {{}});
  layout.donated_inputs = {0};
  EXPECT_FALSE(client_->Compile(layout).ok());  // split in, replicated out: not one buffer
}

}  // namespace
}  // namespace pathways
