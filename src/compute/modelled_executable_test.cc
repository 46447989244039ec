#include "compute/modelled_executable.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/time/clock.h"
#include "collective/collective.h"
#include "compute/device_backend.h"
#include "compute/function_cache.h"
#include "device/simulated_device.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(CostModelTest, ParsesNamesAndTheDefault) {
  auto model = ParseCostModel("add_one=1000,*=25,all_reduce_sum=7");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->CostOf("add_one"), absl::Milliseconds(1));
  EXPECT_EQ(model->CostOf("negate"), absl::Microseconds(25));
  EXPECT_EQ(model->CostOf("all_reduce_sum@x,y"), absl::Microseconds(7));  // by the kernel before '@'
  EXPECT_EQ(ParseCostModel("")->default_cost, CostModel().default_cost);
}

TEST(CostModelTest, BadEntriesAreNamed) {
  for (const char* bad : {"add_one", "=5", "add_one=-1", "add_one=x", "add_one=5,", "f=99999999999999"}) {
    auto model = ParseCostModel(bad);
    ASSERT_TRUE(absl::IsInvalidArgument(model.status())) << bad;
    EXPECT_NE(model.status().message().find("NAME=MICROSECONDS"), std::string::npos) << model.status();
  }
}

TEST(DeviceBackendTest, KindsAreCheckedAndMakeTheirDevices) {
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceBackend::Create("tpu").status()));
  EXPECT_NE(DeviceBackend::Create("tpu").status().message().find("known: cpu, sim"), std::string::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceBackend::Create("cpu", "*=5").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceBackend::Create("sim", "oops").status()));
  auto sim = DeviceBackend::Create("sim", "*=5");
  ASSERT_TRUE(sim.ok()) << sim.status();
  auto device = sim->MakeDevice(3, 1 << 20, "h:1", absl::ZeroDuration());
  EXPECT_EQ(device->kind(), "sim");
  EXPECT_EQ(device->name(), "h:1/sim:3");
  EXPECT_EQ(DeviceBackend().MakeDevice(0, 1 << 20, "h:1", absl::ZeroDuration())->kind(), "cpu");
}

class ModelledKernelTest : public ::testing::Test {
 protected:
  std::shared_ptr<const Executable> Compile(const FunctionBody& body) {
    auto backend = DeviceBackend::Create("sim", "add_one=20000,*=0");
    FunctionCache cache(backend->compiler());
    auto exe = cache.Compile(body);
    EXPECT_TRUE(exe.ok()) << exe.status();
    return exe.ok() ? *exe : nullptr;
  }
  SimulatedDevice device_{0, 1 << 20};
};

TEST_F(ModelledKernelTest, KeepsTheStreamForItsCostAndWritesZeros) {
  auto exe = Compile({FunctionBody::Kind::kBuiltin, "add_one", ""});
  ASSERT_NE(exe, nullptr);
  BufferPtr in = *device_.Allocate(DType::kF32, {4});
  BufferPtr out = *device_.Allocate(DType::kF32, {4});
  std::memset(out->data(), 0xff, 16);
  EXPECT_EQ(device_.stats().memory_used, 32);  // outputs are charged as a real kernel's
  const DeviceBuffer* ins[] = {in.get()};
  DeviceBuffer* outs[] = {out.get()};
  const absl::Time start = absl::Now();
  ASSERT_TRUE(exe->Run(ins, outs).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(20));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(reinterpret_cast<const float*>(out->data())[i], 0.0f);
}

// The thread wakes before the end by what it learned of its timer's lateness, and spins the
// rest: however that estimate moves, no kernel ends before its cost.
TEST(ModelledKernelTimingTest, NoKernelEndsBeforeItsCost) {
  auto backend = DeviceBackend::Create("sim", "add_one=300,*=0");
  ASSERT_TRUE(backend.ok()) << backend.status();
  FunctionCache cache(backend->compiler());
  auto exe = cache.Compile({FunctionBody::Kind::kBuiltin, "add_one", ""});
  ASSERT_TRUE(exe.ok()) << exe.status();
  SimulatedDevice device(0, 1 << 20);
  BufferPtr in = *device.Allocate(DType::kF32, {4});
  BufferPtr out = *device.Allocate(DType::kF32, {4});
  const DeviceBuffer* ins[] = {in.get()};
  DeviceBuffer* outs[] = {out.get()};
  for (int i = 0; i < 200; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE((*exe)->Run(ins, outs).ok());
    ASSERT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(300)) << "kernel " << i;
  }
  // Kernels shorter than how early the thread would wake: spun whole.
  auto tiny_backend = DeviceBackend::Create("sim", "add_one=5,*=0");
  ASSERT_TRUE(tiny_backend.ok()) << tiny_backend.status();
  FunctionCache tiny_cache(tiny_backend->compiler());
  auto tiny = tiny_cache.Compile({FunctionBody::Kind::kBuiltin, "add_one", ""});
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  for (int i = 0; i < 20; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE((*tiny)->Run(ins, outs).ok());
    ASSERT_GE(std::chrono::steady_clock::now() - start, std::chrono::microseconds(5)) << "kernel " << i;
  }
}

TEST_F(ModelledKernelTest, BodiesAreCheckedButTorchScriptIsNotParsed) {
  auto backend = DeviceBackend::Create("sim");
  FunctionCache cache(backend->compiler());
  EXPECT_TRUE(absl::IsInvalidArgument(cache.Compile({FunctionBody::Kind::kTorchScript, "", "x"}).status()));
  auto script = cache.Compile({FunctionBody::Kind::kTorchScript, "f", "def f(x):\n    return x +\n"});
  EXPECT_TRUE(script.ok()) << script.status();
}

// Shards of a gang body that calls a collective meet: each waits for the other, and one that never
// comes times the rest out as a computed collective would.
TEST_F(ModelledKernelTest, ACollectiveBodyMeetsItsGang) {
  collective::CollectiveHub hub("h", nullptr, absl::Milliseconds(300));
  collective::GangLayout layout_value{{2}, {"i"}, {{"h", DeviceId(0)}, {"h", DeviceId(1)}}};
  auto layout = std::make_shared<const collective::GangLayout>(layout_value);
  const std::string script =
      "def step(x):\n    return pathways.all_reduce(x, 'i') + 1\n";
  for (const FunctionBody& body : {FunctionBody{FunctionBody::Kind::kBuiltin, "all_reduce_sum@i", ""},
                                   FunctionBody{FunctionBody::Kind::kTorchScript, "step", script}}) {
    auto exe = Compile(body);
    ASSERT_NE(exe, nullptr);
    auto run_shard = [&](int shard, int64_t run) {
      const std::string client = "c";
      collective::ShardCollectives collectives(hub, layout, {&client, 0, run, 0}, shard);
      collective::ScopedShardCollectives scope(&collectives);
      BufferPtr in = *device_.Allocate(DType::kF32, {1});
      BufferPtr out = *device_.Allocate(DType::kF32, {1});
      const DeviceBuffer* ins[] = {in.get()};
      DeviceBuffer* outs[] = {out.get()};
      return exe->Run(ins, outs);
    };
    absl::Status other;
    std::thread peer([&] { other = run_shard(1, 1); });
    EXPECT_TRUE(run_shard(0, 1).ok());
    peer.join();
    EXPECT_TRUE(other.ok()) << other;
    absl::Status alone = run_shard(0, 2);
    EXPECT_EQ(alone.code(), absl::StatusCode::kDeadlineExceeded) << alone;
    EXPECT_NE(alone.message().find(body.DisplayName()), std::string::npos) << alone;
  }
}

// Without a collective in the body, shards do not wait for each other.
TEST_F(ModelledKernelTest, APlainBodyMeetsNobody) {
  collective::CollectiveHub hub("h", nullptr, absl::Seconds(30));
  auto layout = std::make_shared<const collective::GangLayout>(
      collective::GangLayout{{2}, {"i"}, {{"h", DeviceId(0)}, {"h", DeviceId(1)}}});
  auto exe = Compile({FunctionBody::Kind::kTorchScript, "g", "def g(x):\n    return x * 2\n"});
  ASSERT_NE(exe, nullptr);
  const std::string client = "c";
  collective::ShardCollectives collectives(hub, layout, {&client, 0, 0, 0}, 0);
  collective::ScopedShardCollectives scope(&collectives);
  BufferPtr out = *device_.Allocate(DType::kF32, {1});
  DeviceBuffer* outs[] = {out.get()};
  EXPECT_TRUE(exe->Run({}, outs).ok());
}

}  // namespace
}  // namespace pathways
