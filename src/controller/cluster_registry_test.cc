#include "controller/cluster_registry.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

rpc::RegisterWorkerRequest Worker(const std::string& address, int island, int devices) {
  rpc::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_island(island);
  for (int i = 0; i < devices; ++i) r.add_devices()->set_memory_capacity(1 << 20);
  return r;
}

rpc::AllocateSliceRequest Slice(std::vector<int64_t> mesh, int island = -1) {
  rpc::AllocateSliceRequest r;
  for (int64_t d : mesh) r.add_mesh_shape(d);
  if (island >= 0) {
    r.set_has_island(true);
    r.set_island(island);
  }
  return r;
}

TEST(ClusterRegistryTest, RegistersHostsAndAssignsDeviceIds) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  auto a = registry.RegisterWorker(Worker("h:1", 0, 4), t);
  auto b = registry.RegisterWorker(Worker("h:2", 1, 4), t);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->host_id(), b->host_id());
  EXPECT_EQ(a->device_ids_size(), 4);
  EXPECT_EQ(b->device_ids(0), 4);
  // Re-registering the same address keeps the host id and device ids.
  auto again = registry.RegisterWorker(Worker("h:1", 0, 4), t);
  EXPECT_EQ(again->host_id(), a->host_id());
  EXPECT_EQ(again->device_ids(0), a->device_ids(0));
  EXPECT_EQ(registry.Status(t).hosts_size(), 2);
}

TEST(ClusterRegistryTest, SliceSpansHostsInOrderAndRespectsIslands) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:1", 0, 4), t).ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 4), t).ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:3", 1, 4), t).ok());
  auto s = registry.AllocateSlice(Slice({2, 4}, 0), t);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->devices_size(), 8);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s->devices(i).host_address(), "h:1");
  for (int i = 4; i < 8; ++i) EXPECT_EQ(s->devices(i).host_address(), "h:2");
  auto too_big = registry.AllocateSlice(Slice({16}), t);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_big.status().message().find("16 devices"), std::string::npos);
  EXPECT_EQ(registry.AllocateSlice(Slice({1000, 1000, 1000}), t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AllocateSlice(Slice({}), t).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClusterRegistryTest, HonoursKindAndFreeMemoryConstraints) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest w = Worker("h:1", 0, 4);
  for (auto& d : *w.mutable_devices()) d.set_kind("cpu");
  w.mutable_devices(0)->set_memory_used(1 << 20);  // device 0 is full
  ASSERT_TRUE(registry.RegisterWorker(w, t).ok());
  rpc::AllocateSliceRequest roomy = Slice({3});
  roomy.set_min_free_memory_bytes(1024);
  auto s = registry.AllocateSlice(roomy, t);
  ASSERT_TRUE(s.ok()) << s.status();
  for (const auto& d : s->devices()) EXPECT_NE(d.local_index(), 0);
  roomy.clear_mesh_shape();
  roomy.add_mesh_shape(4);
  auto too_full = registry.AllocateSlice(roomy, t);
  EXPECT_EQ(too_full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_full.status().message().find("with at least 1024 bytes free"), std::string::npos) << too_full.status();
  rpc::AllocateSliceRequest tpu = Slice({1});
  tpu.set_device_kind("tpu");
  auto none = registry.AllocateSlice(tpu, t);
  EXPECT_NE(none.status().message().find("of kind 'tpu'"), std::string::npos) << none.status();
}

TEST(ClusterRegistryTest, SpreadsLoadAcrossDevices) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:1", 0, 2), t).ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 2), t).ok());
  auto first = registry.AllocateSlice(Slice({2}), t);
  auto second = registry.AllocateSlice(Slice({2}), t);
  ASSERT_TRUE(first.ok() && second.ok());
  for (const auto& a : first->devices()) {
    for (const auto& b : second->devices()) EXPECT_NE(a.device_id(), b.device_id());
  }
}

TEST(ClusterRegistryTest, HostsWithoutHeartbeatAreNotUsed) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  auto a = registry.RegisterWorker(Worker("h:1", 0, 4), t);
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 4), t).ok());
  rpc::HeartbeatRequest hb;
  hb.set_host_id(a->host_id());
  rpc::DeviceInfo* d = hb.add_devices();
  d->set_local_index(1);
  d->set_busy_micros(300);
  rpc::ClientTime* share = d->add_client_time();
  share->set_client_id("alice");
  share->set_busy_micros(250);
  EXPECT_TRUE(registry.Heartbeat(hb, t + absl::Seconds(2)));
  EXPECT_EQ(registry.Status(t + absl::Seconds(2)).hosts(0).devices(1).client_time(0).busy_micros(), 250);
  absl::Time later = t + absl::Seconds(4);  // h:2 has been silent for 4 s
  auto status = registry.Status(later);
  EXPECT_TRUE(status.hosts(0).alive());
  EXPECT_FALSE(status.hosts(1).alive());
  EXPECT_EQ(registry.AllocateSlice(Slice({8}), later).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(registry.AllocateSlice(Slice({4}), later).ok());
  rpc::HeartbeatRequest unknown;
  unknown.set_host_id(99);
  EXPECT_FALSE(registry.Heartbeat(unknown, later));
}

}  // namespace
}  // namespace pathways
