// Simulated devices (device kind sim) behind the same client, controller and workers as CPU
// devices: runs, gangs and memory behave as on real devices, kernels take their modelled time.
// Embedded first, then as real processes with several hosts in one worker process.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"
#include "transport/controller_client.h"

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

// Under FIFO the island scheduler releases runs at once and they queue on the devices: the host
// counts each in flight until its shards there are done, and the controller's status shows the
// busiest host's count per island (what the dashboard and /metrics show as runs in flight).
TEST(SimulatedDevicesTest, RunsQueuedOnADeviceAreInFlightOnItsHostAndIsland) {
  LocalClusterOptions options = SimulatedCluster();
  options.num_islands = 1;
  options.hosts_per_island = 1;
  options.backend = *DeviceBackend::Create("sim", "add_one=300000,*=0");  // 0.3 s a kernel
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = *(*cluster)->Connect();
  auto slice = *client->CreateSlice({.mesh_shape = {1}});
  const TensorSpec spec{DType::kF32, {1}};
  auto inc = *client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client->Put(*HostArray::Create(DType::kF32, {1}), slice, {"x"});
  constexpr int kRuns = 10;  // 3 s of work on one device, six heartbeats' worth
  for (int i = 0; i < kRuns; ++i) x = (*client->Call(inc, slice, {x}))[0];
  HostRuntime& host = (*cluster)->worker(0).runtime();
  auto host_in_flight = [&] {
    rpc::HostCounters counters;
    host.DescribeCounters(&counters);
    return counters.runs_in_flight();
  };
  ControllerClient controller((*cluster)->controller_address());
  auto island_in_flight = [&]() -> int64_t {
    auto status = controller.GetStatus();
    if (!status.ok() || status->schedulers_size() != 1) return -1;
    EXPECT_EQ(status->schedulers(0).policy(), "fifo");
    for (const rpc::SchedulerClientStatus& c : status->schedulers(0).clients()) {
      EXPECT_EQ(c.queued_runs(), 0);  // none waits at the scheduler
    }
    return status->schedulers(0).runs_in_flight();
  };
  // Polled (each poll is a count, not a result): at least the runs behind the one computing wait.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  int64_t seen_on_host = 0, seen_on_island = 0;
  while (absl::Now() < deadline && (seen_on_host < 2 || seen_on_island < 2)) {
    seen_on_host = std::max(seen_on_host, host_in_flight());
    seen_on_island = std::max(seen_on_island, island_in_flight());
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_GE(seen_on_host, 2);
  EXPECT_LE(seen_on_host, kRuns);
  EXPECT_GE(seen_on_island, 2);
  ASSERT_TRUE(client->Fetch(x).Await().ok());
  // The last run's tracker goes once its work is done, just after its result shows.
  while (absl::Now() < deadline && host_in_flight() != 0) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(host_in_flight(), 0);
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

// A kernel that does not poll its stop request (a modelled one, like an accelerator's) holds its
// device past the computation timeout and past the grace its waits could take: the worker says
// why it leaves and exits, the call fails with that reason, the client is refused, and another
// client's job runs on the other worker.
TEST(SimulatedDevicesTest, AKernelThatDoesNotStopWhenAskedTakesItsWorkerOut) {
  Subprocess controller, stuck, other;
  auto address = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0",
                                              "--heartbeat-timeout-ms", "5000", "--client-timeout-ms", "1000"});
  ASSERT_TRUE(address.ok()) << address.status();
  const std::vector<std::string> sim = {"--device-kind", "sim", "--sim-cost-us", "hold=60000000,*=0"};
  std::vector<std::string> first = {PATHWAYS_BINARY,
                                    "worker",
                                    "--controller",
                                    *address,
                                    "--devices",
                                    "2",
                                    "--collective-timeout-ms",
                                    "1000",
                                    "--memory-wait-ms",
                                    "500",
                                    "--computation-timeout-ms",
                                    "3000"};
  first.insert(first.end(), sim.begin(), sim.end());
  ASSERT_TRUE(StartWorker(stuck, first).ok());  // registered first: the slice below is placed on it
  std::vector<std::string> second = {PATHWAYS_BINARY, "worker", "--controller", *address, "--devices", "2"};
  second.insert(second.end(), sim.begin(), sim.end());
  ASSERT_TRUE(StartWorker(other, second).ok());

  auto client = Client::Connect(*address);
  ASSERT_TRUE(client.ok()) << client.status();
  VirtualSlice slice = *(*client)->CreateSlice({.mesh_shape = {2}});
  const TensorSpec pair{DType::kF32, {2}};
  auto hold = (*client)->Compile(
      FunctionSpec::Script("hold", "def hold(x):\n    return x + 1.0\n", {pair}, {pair}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(hold.ok()) << hold.status();
  auto call = (*client)->Call(*hold, slice, {*(*client)->Put(*HostArray::Create(DType::kF32, {2}), slice, {"x"})});
  ASSERT_TRUE(call.ok()) << call.status();
  auto got = (*client)->Fetch((*call)[0]).AwaitFor(absl::Seconds(50));
  ASSERT_FALSE(got.ok()) << "a modelled minute passed";
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  for (const char* part : {"past the worker's computation timeout of 3s", "did not stop within 2.5s", "leaves"}) {
    EXPECT_NE(got.status().message().find(part), std::string::npos) << part << " in: " << got.status();
  }
  absl::StatusOr<int> exited = stuck.WaitFor(absl::Seconds(30));
  ASSERT_TRUE(exited.ok()) << "the stuck worker did not leave";
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) == 1) << *exited;
  EXPECT_EQ((*client)->LostSlices().status().code(), absl::StatusCode::kFailedPrecondition);  // refused

  auto next = Client::Connect(*address);
  ASSERT_TRUE(next.ok()) << next.status();
  auto on_other = (*next)->CreateSlice({.mesh_shape = {2}});
  ASSERT_TRUE(on_other.ok()) << on_other.status();
  auto inc = (*next)->Compile(FunctionSpec::Builtin("add_one", {pair}, {pair}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(inc.ok()) << inc.status();
  auto y = (*next)->Call(*inc, *on_other, {*(*next)->Put(*HostArray::Create(DType::kF32, {2}), *on_other, {"x"})});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_TRUE((*next)->Fetch((*y)[0]).AwaitFor(absl::Seconds(30)).ok());
  next->reset();
  client->reset();
  EXPECT_EQ(other.Stop(SIGTERM), 0);
  controller.Stop(SIGTERM);
}

TEST(SimulatedDevicesTest, BadWorkerFlagsAreNamed) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--device-kind", "tpu"}, "unknown device kind 'tpu'"},
      {{"--device-kind", "sim", "--sim-cost-us", "add_one"}, "NAME=MICROSECONDS"},
      {{"--sim-cost-us", "*=5"}, "simulated devices only"},
      {{"--hosts", "0"}, "--hosts must be between"},
      {{"--function-ops", "all"}, "unknown function ops 'all'; known: vetted (the default), public"},
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
