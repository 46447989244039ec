// Island gang scheduling: two clients whose gang programs share devices, with collectives inside,
// complete however their ops reach the hosts; with the scheduler bypassed, the same clients
// deadlock, which the collectives' timeout turns into DeadlineExceeded. A tenant that goes away
// mid-gang does not hold the other tenants' gangs.
#include <thread>

#include "client/client.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

// Long enough for a consistently ordered gang to wait out the skew below on a loaded machine;
// short enough that the deadlock without the scheduler is detected quickly.
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(1);
constexpr absl::Duration kPatientCollectiveTimeout = absl::Seconds(20);
// Long against the time the clients take to submit: host 0 applies client A's direct ops this
// late and host 1 client B's, so without a common order each host starts the other client's gang
// first.
constexpr absl::Duration kSkew = absl::Milliseconds(300);

struct Tenant {
  std::unique_ptr<Client> client;
  VirtualSlice slice;
  CompiledFunction psum;
  ShardedArray x;
  float value;
};

class GangSchedulingTest : public ::testing::Test {
 protected:
  void Start(bool bypass_scheduler) {
    LocalClusterOptions options;
    options.num_islands = 1;
    options.hosts_per_island = 2;
    options.devices_per_host = 1;
    options.collective_timeout = bypass_scheduler ? kCollectiveTimeout : kPatientCollectiveTimeout;
    auto cluster = LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ClientOptions client_options;
    client_options.TEST_bypass_scheduler = bypass_scheduler;
    for (float value : {1.0f, 10.0f}) {
      Tenant t;
      t.client = *Client::Connect(cluster_->controller_address(), client_options);
      auto slice = t.client->CreateSlice({.mesh_shape = {2}});
      ASSERT_TRUE(slice.ok()) << slice.status();
      ASSERT_EQ(slice->host_addresses().size(), 2u);  // the two tenants share both devices
      t.slice = *slice;
      const TensorSpec spec{DType::kF32, {2}};
      t.psum = *t.client->Compile(FunctionSpec::Builtin("all_reduce_sum@x", {spec}, {spec}, {{"x"}}, {{"x"}}));
      t.value = value;
      tenants_.push_back(std::move(t));
    }
    // Host 0 sees tenant 0's direct ops late, host 1 tenant 1's.
    for (int h = 0; h < 2; ++h) cluster_->worker(h).runtime().TEST_DelayOpsFrom(tenants_[h].client->id(), kSkew);
    for (Tenant& t : tenants_) {
      t.x = *t.client->Put(*HostArray::FromVector<float>(DType::kF32, {2}, {t.value, t.value}), t.slice, {"x"});
    }
  }

  // Each tenant submits `runs` gang runs from its own thread; returns every result's status.
  std::vector<absl::Status> RunBoth(int runs) {
    std::vector<absl::Status> statuses(tenants_.size() * runs);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < tenants_.size(); ++i) {
      threads.emplace_back([&, i] {
        Tenant& t = tenants_[i];
        std::vector<ShardedArray> outs;
        for (int r = 0; r < runs; ++r) {
          auto out = t.client->Call(t.psum, t.slice, {t.x});
          if (!out.ok()) {
            statuses[i * runs + r] = out.status();
            continue;
          }
          outs.push_back((*out)[0]);
        }
        for (size_t r = 0; r < outs.size(); ++r) {
          auto got = t.client->Fetch(outs[r]).Await();
          absl::Status& s = statuses[i * runs + r];
          if (!got.ok()) {
            s = got.status();
          } else if (got->data<float>()[0] != 2 * t.value || got->data<float>()[1] != 2 * t.value) {
            s = absl::InternalError(absl::StrCat("tenant ", i, " got ", got->data<float>()[0]));
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    return statuses;
  }

  std::unique_ptr<LocalCluster> cluster_;
  std::vector<Tenant> tenants_;
};

TEST_F(GangSchedulingTest, TenantsSharingDevicesWithCollectivesAllComplete) {
  Start(/*bypass_scheduler=*/false);
  for (const absl::Status& s : RunBoth(40)) EXPECT_TRUE(s.ok()) << s;
}

TEST_F(GangSchedulingTest, WithoutTheSchedulerTheSameTenantsDeadlock) {
  Start(/*bypass_scheduler=*/true);
  int deadlocked = 0;
  for (const absl::Status& s : RunBoth(2)) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kAborted) ++deadlocked;
  }
  // Each host started the other tenant's gang first: their collectives waited on each other
  // (members on one host, until the timeout) or met the other gang's messages across hosts
  // (Aborted at once), and failed instead of hanging.
  EXPECT_GT(deadlocked, 0);
}

// Host `h`'s collective counters: calls inside its hub now, and calls that failed.
rpc::HostCounters CountersOf(LocalCluster& cluster, int h) {
  rpc::HostCounters counters;
  cluster.worker(h).runtime().DescribeCounters(&counters);
  return counters;
}

// A tenant that goes away while its gang run is started on one host and never will be on the
// other (its program has not reached host 1: the tenant's own ops arrive there 6 s late, after it
// is gone). Host 0 collects the tenant at the point of the island's order where host 1 does, and
// its all_reduce, which waits for host 1, stops waiting then: another tenant's gang on the same
// devices runs at once, not after the collective timeout (30 s here) that host 0 waited out
// before.
TEST(GoneTenantTest, ATenantThatGoesAwayMidGangDoesNotHoldOthersDevicesUntilTheTimeout) {
  LocalClusterOptions options;
  options.num_islands = 1;
  options.hosts_per_island = 2;
  options.devices_per_host = 1;
  options.collective_timeout = absl::Seconds(30);
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const TensorSpec spec{DType::kF32, {2}};
  auto tenant = [&](float value) {
    auto t = std::make_unique<Tenant>();
    t->client = *Client::Connect((*cluster)->controller_address());
    t->slice = *t->client->CreateSlice({.mesh_shape = {2}});
    t->psum = *t->client->Compile(FunctionSpec::Builtin("all_reduce_sum@x", {spec}, {spec}, {{"x"}}, {{"x"}}));
    t->x = *t->client->Put(*HostArray::FromVector<float>(DType::kF32, {2}, {value, value}), t->slice, {"x"});
    t->value = value;
    return t;
  };
  auto psum = [](Tenant& t) -> absl::Status {
    auto out = t.client->Call(t.psum, t.slice, {t.x});
    if (!out.ok()) return out.status();
    auto got = t.client->Fetch((*out)[0]).AwaitFor(absl::Seconds(60));
    if (!got.ok()) return got.status();
    if (got->data<float>()[0] != 2 * t.value) return absl::InternalError(absl::StrCat("got ", got->data<float>()[0]));
    return absl::OkStatus();
  };
  std::unique_ptr<Tenant> other = tenant(1);
  ASSERT_TRUE(psum(*other).ok());
  std::unique_ptr<Tenant> gone = tenant(10);
  ASSERT_EQ(gone->slice.host_addresses().size(), 2u);
  (*cluster)->worker(1).runtime().TEST_DelayOpsFrom(gone->client->id(), absl::Seconds(6));
  ASSERT_TRUE(gone->client->Call(gone->psum, gone->slice, {gone->x}).ok());
  // Host 0 waits in the gang's all_reduce for host 1.
  for (const absl::Time until = absl::Now() + absl::Seconds(20);
       CountersOf(**cluster, 0).collectives_in_progress() == 0 && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(CountersOf(**cluster, 0).collectives_in_progress(), 1);
  const int64_t failed = CountersOf(**cluster, 0).collectives_failed();
  // The last handle goes: the client says goodbye, and the controller retires it through the
  // island's scheduler.
  gone.reset();

  const absl::Time start = absl::Now();
  const absl::Status s = psum(*other);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "the other tenant waited for the gone one's all_reduce";
  EXPECT_EQ(CountersOf(**cluster, 0).collectives_failed(), failed + 1);
}

// Clients state their own weights; the operator bounds them. A client stating more than the
// cluster allows has its runs refused with the reason; one within the bound runs.
TEST(SchedulingWeightTest, AWeightAboveTheClustersLimitIsRefused) {
  LocalClusterOptions options;
  options.num_islands = 1;
  options.hosts_per_island = 1;
  options.devices_per_host = 1;
  options.scheduler.policy = SchedulingPolicy::kProportionalShare;
  options.scheduler.max_client_weight = 4;
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const TensorSpec spec{DType::kF32, {2}};
  for (double weight : {4.0, 100.0}) {
    auto client = Client::Connect((*cluster)->controller_address(), {.weight = weight});
    ASSERT_TRUE(client.ok()) << client.status();
    VirtualSlice slice = *(*client)->CreateSlice({.mesh_shape = {1}});
    CompiledFunction inc = *(*client)->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{""}}, {{""}}));
    ShardedArray x = *(*client)->Put(*HostArray::FromVector<float>(DType::kF32, {2}, {1, 2}), slice, {""});
    auto out = (*client)->Call(inc, slice, {x});
    absl::Status s = out.ok() ? (*client)->Fetch((*out)[0]).AwaitFor(absl::Seconds(30)).status() : out.status();
    if (weight <= 4) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("scheduling weight 100"), std::string::npos) << s;
    }
  }
}

}  // namespace
}  // namespace pathways
