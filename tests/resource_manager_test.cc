// Hosts join and leave a running cluster: slices on a host that stops heartbeating are reported
// lost, runs on them fail naming the host, and a remapped slice runs again (its programs lowered
// for the new devices); a worker started later is usable.
#include "client/client.h"
#include "cluster/local_cluster.h"
#include "client/program.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

constexpr absl::Duration kHeartbeatTimeout = absl::Milliseconds(400);

// Waits (bounded) until the controller reports `slice_id` lost; the reason, or an error.
absl::StatusOr<std::string> WaitUntilLost(Client& client, SliceId slice_id) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    auto lost = client.LostSlices();
    if (!lost.ok()) return lost.status();
    for (const Client::LostSlice& s : *lost) {
      if (s.slice_id == slice_id) return s.reason;
    }
    absl::SleepFor(kHeartbeatTimeout / 8);  // polls the controller's view; liveness is time-based
  }
  return absl::DeadlineExceededError("slice never reported lost");
}

TEST(ResourceManagerTest, ASliceOnADepartedHostIsLostAndRunsAgainOnceRemapped) {
  LocalClusterOptions options;
  options.num_islands = 1;
  options.hosts_per_island = 2;
  options.devices_per_host = 2;
  options.heartbeat_timeout = kHeartbeatTimeout;
  auto cluster = *LocalCluster::Start(options);
  auto client = *cluster->Connect();
  // Placement spreads load: the first slice takes host 0's devices, the second host 1's.
  VirtualSlice a = *client->CreateSlice({.mesh_shape = {2}});
  VirtualSlice b = *client->CreateSlice({.mesh_shape = {2}});
  ASSERT_EQ(a.host_addresses().size(), 1u);
  ASSERT_EQ(b.host_addresses().size(), 1u);
  ASSERT_NE(a.host_addresses()[0], b.host_addresses()[0]);
  const std::string departed = b.host_addresses()[0];
  const int departed_index = departed == cluster->worker(0).address() ? 0 : 1;

  const TensorSpec spec{DType::kF32, {4}};
  auto inc = *client->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  auto sum = *client->Compile(FunctionSpec::Builtin("all_reduce_sum@x", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ProgramBuilder builder("inc_then_sum");
  TracedValue v = builder.Arg(spec);
  v = (*builder.Call(inc, b, {v}))[0];
  v = (*builder.Call(sum, b, {v}))[0];
  Program program = *builder.Build({v});
  auto run = [&](const VirtualSlice& on) -> absl::StatusOr<HostArray> {
    auto x = client->Put(*HostArray::FromVector<float>(DType::kF32, {4}, {1, 2, 3, 4}), on, {"x"});
    if (!x.ok()) return x.status();
    auto out = client->Run(program, {*x});
    if (!out.ok()) return out.status();
    return client->Fetch((*out)[0]).Await();
  };
  auto before = run(b);
  ASSERT_TRUE(before.ok()) << before.status();
  // Shards {2,3} and {4,5} summed: 6, 8 on each shard.
  EXPECT_EQ(std::vector<float>(before->data<float>(), before->data<float>() + 4), (std::vector<float>{6, 8, 6, 8}));
  const int64_t lowerings = client->stats().lowerings;

  auto kept = client->Put(*HostArray::FromVector<float>(DType::kF32, {4}, {1, 2, 3, 4}), b, {"x"});
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_TRUE(client->Ready(*kept).Await().ok());
  cluster->StopWorker(departed_index);
  auto reason = WaitUntilLost(*client, b.id());
  ASSERT_TRUE(reason.ok()) << reason.status();
  EXPECT_NE(reason->find(departed), std::string::npos) << *reason;
  // Fetching an array the host held fails with the transport's words and the controller's reason.
  absl::Status fetched = client->Fetch(*kept).Await().status();
  EXPECT_TRUE(absl::IsUnavailable(fetched)) << fetched;
  EXPECT_NE(fetched.message().find("the controller says the array's slice lost hosts: "), std::string::npos) << fetched;
  EXPECT_NE(fetched.message().find(*reason), std::string::npos) << fetched;
  auto lost = *client->LostSlices();
  ASSERT_EQ(lost.size(), 1u);  // slice a is on the host that stayed
  // A run on the lost slice fails, naming the host.
  auto failed = run(b);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find(departed), std::string::npos) << failed.status();

  // A worker started now joins; the remapped slice runs on live devices, lowered anew.
  ASSERT_TRUE(cluster->AddWorker(0).ok());
  ASSERT_TRUE(client->RemapSlice(b).ok());
  for (const std::string& h : b.host_addresses()) EXPECT_NE(h, departed);
  EXPECT_TRUE(client->LostSlices()->empty());
  auto after = run(b);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(std::vector<float>(after->data<float>(), after->data<float>() + 4), (std::vector<float>{6, 8, 6, 8}));
  EXPECT_EQ(client->stats().lowerings, lowerings + 1);

  // Another client cannot remap or see this client's slices.
  auto other = *cluster->Connect();
  EXPECT_TRUE(other->LostSlices()->empty());
  EXPECT_FALSE(other->RemapSlice(b).ok());
}

}  // namespace
}  // namespace pathways
