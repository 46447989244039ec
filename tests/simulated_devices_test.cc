// Simulated devices (device kind sim) behind the same client, controller and workers as CPU
// devices: runs, gangs and memory behave as on real devices, kernels take their modelled time.
// Embedded first, then as real processes with several hosts in one worker process.
#include <signal.h>
#include <sys/wait.h>

#include <set>

#include "absl/strings/match.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

constexpr int64_t kCostUs = 2000;

LocalClusterOptions SimulatedCluster() {
  LocalClusterOptions options;
  options.num_islands = 1;
  options.hosts_per_island = 4;
  options.devices_per_host = 2;
  options.device_memory_bytes = 1 << 20;
  options.backend = *DeviceBackend::Create("sim", "add_one=" + std::to_string(kCostUs) + ",*=0");
  return options;
}

TEST(SimulatedDevicesTest, AChainTakesItsModelledTimeAndGangsMeetAcrossHosts) {
  auto cluster = LocalCluster::Start(SimulatedCluster());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto described = (*client)->DescribeCluster();
  ASSERT_TRUE(described.ok());
  EXPECT_NE(described->find("sim"), std::string::npos) << *described;
  EXPECT_FALSE((*client)->CreateSlice({.mesh_shape = {2}, .device_kind = "cpu"}).ok());

  auto slice = (*client)->CreateSlice({.mesh_shape = {8}, .device_kind = "sim"});
  ASSERT_TRUE(slice.ok()) << slice.status();
  const TensorSpec spec{DType::kF32, {8}};
  auto inc = (*client)->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  auto sum = (*client)->Compile(FunctionSpec::Builtin("all_reduce_sum@x", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(inc.ok() && sum.ok());
  constexpr int kNodes = 8;
  ProgramBuilder builder("modelled_chain");
  TracedValue v = builder.Arg(spec);
  for (int i = 0; i < kNodes; ++i) v = (*builder.Call(*inc, *slice, {v}))[0];
  v = (*builder.Call(*sum, *slice, {v}))[0];  // a gang over all four hosts
  auto chain = builder.Build({v});
  ASSERT_TRUE(chain.ok()) << chain.status();

  HostArray ones = *HostArray::Create(DType::kF32, {8});
  for (int i = 0; i < 8; ++i) ones.mutable_data<float>()[i] = 1;
  auto x = (*client)->Put(ones, *slice, {"x"});
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE((*client)->Ready(*x).Await().ok());
  const absl::Time start = absl::Now();
  auto out = (*client)->Run(*chain, {*x});
  ASSERT_TRUE(out.ok()) << out.status();
  auto fetched = (*client)->Fetch((*out)[0]).Await();
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  // Each shard's chain runs its eight kernels one after another on its in-order device.
  EXPECT_GE(absl::Now() - start, absl::Microseconds(kNodes * kCostUs));
  // Modelled kernels compute nothing: their outputs are zeros, whatever went in.
  for (int i = 0; i < 8; ++i) EXPECT_EQ(fetched->data<float>()[i], 0.0f);

  // What the devices report is real: the put's and the outputs' buffers were charged and freed,
  // and the work shows in every device's trace.
  int64_t executed = 0;
  for (int w = 0; w < (*cluster)->num_workers(); ++w) {
    for (int d = 0; d < (*cluster)->worker(w).runtime().num_devices(); ++d) {
      const DeviceStats stats = (*cluster)->worker(w).runtime().device(d).stats();
      EXPECT_GE(stats.busy_micros, kNodes * kCostUs);
      EXPECT_GT(stats.memory_peak, 0);
      executed += stats.executed;
    }
  }
  EXPECT_GE(executed, 8 * (kNodes + 1));
}

// What is checked on real devices is checked here too, and the cluster serves on after a refusal.
TEST(SimulatedDevicesTest, BodiesAreCheckedAsOnRealDevices) {
  auto cluster = LocalCluster::Start(SimulatedCluster());
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = *(*cluster)->Connect();
  auto slice = *client->CreateSlice({.mesh_shape = {2}});
  const TensorSpec spec{DType::kF32, {2}};
  auto unknown = client->Compile(FunctionSpec::Builtin("no_such_kernel", {spec}, {spec}, {{"x"}}, {{"x"}}));
  EXPECT_TRUE(absl::IsNotFound(unknown.status())) << unknown.status();
  EXPECT_NE(unknown.status().message().find("no_such_kernel"), std::string::npos) << unknown.status();
  // Shapes are still checked by the client, so a wrong input fails before any device sees it.
  auto inc = *client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  auto wrong = client->Put(*HostArray::Create(DType::kF32, {4}), slice, {"x"});
  ASSERT_TRUE(wrong.ok());
  auto bad = client->Call(inc, slice, {*wrong});
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  auto good = client->Call(inc, slice, {*client->Put(*HostArray::Create(DType::kF32, {2}), slice, {"x"})});
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(client->Fetch((*good)[0]).Await().ok());
}

// `pathways worker --hosts N --device-kind sim`: N hosts in one process, each registered with the
// controller as its own host; a gang over all of them runs.
TEST(SimulatedDevicesTest, OneWorkerProcessServesSeveralHosts) {
  Subprocess controller;
  auto address = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"});
  ASSERT_TRUE(address.ok()) << address.status();
  Subprocess worker;
  ASSERT_TRUE(worker
                  .Start({PATHWAYS_BINARY, "worker", "--controller", *address, "--hosts", "3", "--devices", "2",
                          "--device-kind", "sim", "--sim-cost-us", "*=100", "--device-memory", "16MiB"})
                  .ok());
  for (int h = 0; h < 3; ++h) {
    auto line = worker.WaitForLine("serving", absl::Seconds(60));
    ASSERT_TRUE(line.ok()) << line.status();
    EXPECT_NE(line->find("2 sim devices"), std::string::npos) << *line;
  }
  auto client = Client::Connect(*address);
  ASSERT_TRUE(client.ok()) << client.status();
  auto slice = (*client)->CreateSlice({.mesh_shape = {6}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(std::set<std::string>(slice->host_addresses().begin(), slice->host_addresses().end()).size(), 3u);
  const TensorSpec spec{DType::kF32, {6}};
  auto sum = (*client)->Compile(FunctionSpec::Builtin("all_reduce_sum", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(sum.ok());
  auto x = (*client)->Put(*HostArray::Create(DType::kF32, {6}), *slice, {"x"});
  ASSERT_TRUE(x.ok());
  for (int i = 0; i < 20; ++i) {
    auto y = (*client)->Call(*sum, *slice, {*x});
    ASSERT_TRUE(y.ok()) << y.status();
    x = (*y)[0];
  }
  EXPECT_TRUE((*client)->Fetch(*x).Await().ok());
  client->reset();
  EXPECT_EQ(worker.Stop(SIGTERM), 0);
  controller.Stop(SIGTERM);
}

TEST(SimulatedDevicesTest, BadWorkerFlagsAreNamed) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--device-kind", "tpu"}, "unknown device kind 'tpu'"},
      {{"--device-kind", "sim", "--sim-cost-us", "add_one"}, "NAME=MICROSECONDS"},
      {{"--sim-cost-us", "*=5"}, "simulated devices only"},
      {{"--hosts", "0"}, "--hosts must be between"},
      {{"--hosts", "2", "--listen", "127.0.0.1:45678"}, "port 0"},
      // A computation's time includes its collective and memory waits (30 s and 10 s by default).
      {{"--computation-timeout-ms", "5000"}, "more than --collective-timeout-ms plus --memory-wait-ms (40000)"},
      {{"--computation-timeout-ms", "-1"}, "--computation-timeout-ms must be 0 (none)"},
  };
  for (const auto& [extra, expected] : cases) {
    std::string command = std::string(PATHWAYS_BINARY) + " worker --controller 127.0.0.1:1";
    for (const auto& e : extra) command += " '" + e + "'";
    auto [status, output] = RunShell(command, absl::Seconds(30));
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << command << ": " << output;
    EXPECT_NE(output.find(expected), std::string::npos) << command << ": " << output;
  }
}

}  // namespace
}  // namespace pathways
