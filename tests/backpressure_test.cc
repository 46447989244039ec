// Device memory as a budget: computations whose outputs do not fit wait for other work's
// buffers to be released (backpressure), an allocation larger than the device fails at once,
// and a wait that nothing will end is reported instead of hanging.
#include <thread>

#include "client/client.h"
#include "cluster/local_cluster.h"
#include "client/program.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

constexpr int64_t kBudget = int64_t{1} << 20;  // one device of 1 MiB

std::unique_ptr<LocalCluster> OneDevice(absl::Duration memory_wait) {
  LocalClusterOptions options;
  options.num_islands = 1;
  options.hosts_per_island = 1;
  options.devices_per_host = 1;
  options.device_memory_bytes = kBudget;
  options.memory_wait = memory_wait;
  return *LocalCluster::Start(options);
}

TEST(BackpressureTest, ProgramsWhosePeaksTogetherExceedTheBudgetAllComplete) {
  auto cluster = OneDevice(absl::Seconds(60));
  // Without waiting (memory_wait 0) this fails with ResourceExhausted. Four clients at once, each run holding 512 KiB at its peak (a 256 KiB intermediate and a
  // 256 KiB result): 2 MiB together on a 1 MiB device.
  std::vector<absl::Status> failures(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto client = *cluster->Connect();
      VirtualSlice slice = *client->CreateSlice({.mesh_shape = {1}});
      const TensorSpec col{DType::kF32, {256, 1}}, row{DType::kF32, {1, 256}}, square{DType::kF32, {256, 256}};
      auto outer = *client->Compile(FunctionSpec::Builtin("matmul", {col, row}, {square}));
      auto inc = *client->Compile(FunctionSpec::Builtin("add_one", {square}, {square}));
      ProgramBuilder builder("outer_then_inc");
      TracedValue a = builder.Arg(col), b = builder.Arg(row);
      TracedValue y = (*builder.Call(outer, slice, {a, b}))[0];
      Program program = *builder.Build({(*builder.Call(inc, slice, {y}))[0]});
      const float k = static_cast<float>(t + 1);
      ShardedArray ca = *client->Put(*HostArray::FromVector<float>(DType::kF32, {256, 1}, std::vector<float>(256, k)), slice);
      ShardedArray cb = *client->Put(*HostArray::FromVector<float>(DType::kF32, {1, 256}, std::vector<float>(256, 1)), slice);
      for (int i = 0; i < 10; ++i) {
        auto out = client->Run(program, {ca, cb});
        if (!out.ok()) {
          failures[t] = out.status();
          return;
        }
        auto z = client->Fetch((*out)[0]).Await();
        if (!z.ok()) {
          failures[t] = z.status();
          return;
        }
        if (z->data<float>()[0] != k + 1 || z->data<float>()[256 * 256 - 1] != k + 1) {
          failures[t] = absl::InternalError(absl::StrCat("client ", t, " got ", z->data<float>()[0]));
          return;
        }
      }  // each result is dropped here, and its memory goes back to the device
    });
  }
  for (auto& th : threads) th.join();
  for (const absl::Status& s : failures) EXPECT_TRUE(s.ok()) << s;
}

TEST(BackpressureTest, AnAllocationLargerThanTheDeviceFailsAtOnceNamingSizes) {
  auto cluster = OneDevice(absl::Seconds(60));
  auto client = *cluster->Connect();
  VirtualSlice slice = *client->CreateSlice({.mesh_shape = {1}});
  const TensorSpec col{DType::kF32, {1024, 1}}, row{DType::kF32, {1, 1024}}, huge{DType::kF32, {1024, 1024}};
  auto outer = *client->Compile(FunctionSpec::Builtin("matmul", {col, row}, {huge}));
  ShardedArray a = *client->Put(*HostArray::Create(DType::kF32, {1024, 1}), slice);
  ShardedArray b = *client->Put(*HostArray::Create(DType::kF32, {1, 1024}), slice);
  const absl::Time start = absl::Now();
  auto got = client->Fetch((*client->Call(outer, slice, {a, b}))[0]).Await();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));  // did not wait for memory that can never be there
  ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_NE(got.status().message().find("4194304 bytes exceeds the device's whole budget of 1048576"),
            std::string::npos)
      << got.status();
  EXPECT_NE(got.status().message().find("cpu:0"), std::string::npos) << got.status();
}

TEST(BackpressureTest, AWaitThatNothingWillEndIsReportedNotHung) {
  auto cluster = OneDevice(absl::Milliseconds(300));
  auto client = *cluster->Connect();
  VirtualSlice slice = *client->CreateSlice({.mesh_shape = {1}});
  // The client holds 768 KiB and asks for 256 KiB more: only dropping its own array would make
  // room, and it waits for the result before it would. The rule: wait `memory_wait`, then fail.
  ShardedArray held = *client->Put(*HostArray::Create(DType::kF32, {3 * 64 * 1024}), slice);
  const TensorSpec col{DType::kF32, {256, 1}}, row{DType::kF32, {1, 256}}, square{DType::kF32, {256, 256}};
  auto outer = *client->Compile(FunctionSpec::Builtin("matmul", {col, row}, {square}));
  ShardedArray a = *client->Put(*HostArray::Create(DType::kF32, {256, 1}), slice);
  ShardedArray b = *client->Put(*HostArray::Create(DType::kF32, {1, 256}), slice);
  auto got = client->Fetch((*client->Call(outer, slice, {a, b}))[0]).Await();
  ASSERT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_NE(got.status().message().find("after waiting 300ms"), std::string::npos) << got.status();
  // Dropping the array makes room: the same call now runs.
  held = ShardedArray();
  auto again = client->Fetch((*client->Call(outer, slice, {a, b}))[0]).Await();
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace pathways
