#include "controller/cluster_registry.h"

#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "controller/registry_testing.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

using testing::Slice;
using testing::Worker;

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
  // Devices sit in their island's mesh at (host's rank in the island, local index).
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:3", 0, 4), t).ok());
  rpc::ClusterStatus status = registry.Status(t);
  EXPECT_EQ(std::vector<int>(status.hosts(0).devices(3).coords().begin(), status.hosts(0).devices(3).coords().end()),
            (std::vector<int>{0, 3}));
  EXPECT_EQ(std::vector<int>(status.hosts(1).devices(1).coords().begin(), status.hosts(1).devices(1).coords().end()),
            (std::vector<int>{0, 1}));  // first host of island 1
  EXPECT_EQ(status.hosts(2).devices(2).coords(0), 1);  // second host of island 0
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

// Without a kind asked for, a slice still gets devices of one kind: the most numerous.
TEST(ClusterRegistryTest, ASliceNeverMixesDeviceKinds) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest cpu = Worker("h:1", 0, 2);
  for (auto& d : *cpu.mutable_devices()) d.set_kind("cpu");
  rpc::RegisterWorkerRequest sim = Worker("h:2", 0, 3);
  for (auto& d : *sim.mutable_devices()) d.set_kind("sim");
  ASSERT_TRUE(registry.RegisterWorker(cpu, t).ok());
  ASSERT_TRUE(registry.RegisterWorker(sim, t).ok());
  auto s = registry.AllocateSlice(Slice({3}), t);
  ASSERT_TRUE(s.ok()) << s.status();
  for (const auto& d : s->devices()) EXPECT_EQ(d.host_address(), "h:2");
  // Five devices exist, but no five of one kind.
  EXPECT_EQ(registry.AllocateSlice(Slice({5}), t).status().code(), absl::StatusCode::kResourceExhausted);
  rpc::AllocateSliceRequest on_cpu = Slice({2});
  on_cpu.set_device_kind("cpu");
  auto c = registry.AllocateSlice(on_cpu, t);
  ASSERT_TRUE(c.ok()) << c.status();
  for (const auto& d : c->devices()) EXPECT_EQ(d.host_address(), "h:1");
}

// The most numerous kind is tried first, but a kind that fits one island wins over one that
// does not.
TEST(ClusterRegistryTest, AKindThatFitsAnIslandIsTakenOverAMoreNumerousOne) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest cpu = Worker("c:1", 0, 8);
  for (auto& d : *cpu.mutable_devices()) d.set_kind("cpu");
  ASSERT_TRUE(registry.RegisterWorker(cpu, t).ok());
  for (int island = 1; island <= 3; ++island) {
    rpc::RegisterWorkerRequest sim = Worker(absl::StrCat("s:", island), island, 3);
    for (auto& d : *sim.mutable_devices()) d.set_kind("sim");
    ASSERT_TRUE(registry.RegisterWorker(sim, t).ok());
  }
  auto s = registry.AllocateSlice(Slice({8}), t);  // 9 sim devices, but no island has 8 of them
  ASSERT_TRUE(s.ok()) << s.status();
  for (const auto& d : s->devices()) EXPECT_EQ(d.host_address(), "c:1");
  auto small = registry.AllocateSlice(Slice({3}), t);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_NE(small->devices(0).host_address(), "c:1");  // sim is the more numerous kind
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

TEST(ClusterRegistryTest, AHeartbeatsCountersAreKeptAndABrokenHistogramIsNot) {
  ClusterRegistry registry(absl::Seconds(3));
  const absl::Time t = absl::UnixEpoch();
  auto a = registry.RegisterWorker(Worker("h:1", 0, 1), t);
  ASSERT_TRUE(a.ok());
  rpc::HeartbeatRequest hb;
  hb.set_host_id(a->host_id());
  hb.set_address("h:1");
  rpc::HostCounters* c = hb.mutable_counters();
  c->set_collectives(5);
  c->set_block_bytes_sent(1234);
  c->add_latency_bounds_us(100);
  c->add_latency_buckets(4);
  c->add_latency_buckets(1);
  c->set_latency_sum_us(700);
  for (int i = 0; i < 1000; ++i) {  // more labels than a worker keeps, and longer ones
    rpc::ClientCount* failed = c->add_failed_shards();
    failed->set_client_id(std::string(20, 'a' + i % 26));
    failed->set_count(i);
  }
  ASSERT_EQ(registry.Heartbeat(hb, t + absl::Seconds(1)), ClusterRegistry::Beat::kAlive);
  rpc::HostCounters kept = registry.Status(t + absl::Seconds(1)).hosts(0).counters();
  ASSERT_EQ(kept.failed_shards_size(), ClusterRegistry::kMaxFailureLabels);
  EXPECT_EQ(kept.failed_shards(0).client_id(), "aaaaaaaa");
  EXPECT_EQ(kept.collectives(), 5);
  EXPECT_EQ(kept.block_bytes_sent(), 1234);
  EXPECT_EQ(kept.latency_buckets_size(), 2);
  // Buckets that do not match the bounds, or bounds out of order: the histogram goes, the rest stays.
  c->add_latency_buckets(9);
  ASSERT_EQ(registry.Heartbeat(hb, t + absl::Seconds(2)), ClusterRegistry::Beat::kAlive);
  kept = registry.Status(t + absl::Seconds(2)).hosts(0).counters();
  EXPECT_EQ(kept.latency_buckets_size(), 0);
  EXPECT_EQ(kept.latency_sum_us(), 0);
  EXPECT_EQ(kept.collectives(), 5);
  c->clear_latency_buckets();
  for (int n : {1, 2, 3}) c->add_latency_buckets(n);
  c->add_latency_bounds_us(50);
  ASSERT_EQ(registry.Heartbeat(hb, t + absl::Seconds(3)), ClusterRegistry::Beat::kAlive);
  EXPECT_EQ(registry.Status(t + absl::Seconds(3)).hosts(0).counters().latency_bounds_us_size(), 0);
  // Equal bounds (two series of one `le`), NaN, a negative count: none is served.
  auto kept_with = [&](std::vector<double> bounds, std::vector<int64_t> buckets) {
    c->clear_latency_bounds_us();
    c->clear_latency_buckets();
    for (double b : bounds) c->add_latency_bounds_us(b);
    for (int64_t n : buckets) c->add_latency_buckets(n);
    EXPECT_EQ(registry.Heartbeat(hb, t + absl::Seconds(3)), ClusterRegistry::Beat::kAlive);
    return registry.Status(t + absl::Seconds(3)).hosts(0).counters().latency_buckets_size() > 0;
  };
  EXPECT_TRUE(kept_with({100, 200}, {1, 2, 3}));
  EXPECT_FALSE(kept_with({100, 100}, {1, 2, 3}));
  EXPECT_FALSE(kept_with({100, std::nan(""), 50}, {1, 2, 3, 4}));
  EXPECT_FALSE(kept_with({100, 200}, {1, -2, 3}));
  EXPECT_FALSE(kept_with({100, 200}, {1, std::numeric_limits<int64_t>::max(), 3}));
}

TEST(ClusterRegistryTest, TheTimelineKeepsTheLastSecondsOfEachDevicesWork) {
  ClusterRegistry registry(absl::Seconds(60));
  const absl::Time t = absl::FromUnixSeconds(1000);
  auto a = registry.RegisterWorker(Worker("h:1", 0, 2), t);
  ASSERT_TRUE(a.ok());
  // One heartbeat at `now` reporting, for `device`, one bucket of a second from `start_s`.
  auto beat = [&](absl::Time now, int device, int64_t start_s, const std::string& client, int64_t micros) {
    rpc::HeartbeatRequest hb;
    hb.set_host_id(a->host_id());
    hb.set_address("h:1");
    rpc::DeviceInfo* d = hb.add_devices();
    d->set_local_index(device);
    rpc::WorkBucket* b = d->add_recent_work();
    b->set_start_us(start_s * 1'000'000);
    b->set_end_us((start_s + 1) * 1'000'000);
    rpc::ClientTime* busy = b->add_busy();
    busy->set_client_id(client);
    busy->set_busy_micros(micros);
    return registry.Heartbeat(hb, now);
  };
  ASSERT_EQ(beat(t + absl::Seconds(1), 0, 999, "aaaaaaaa", 100), ClusterRegistry::Beat::kAlive);
  ASSERT_EQ(beat(t + absl::Seconds(2), 1, 1001, std::string(40, 'b'), 200), ClusterRegistry::Beat::kAlive);
  // The same bucket again (work that ended since it was first reported), another client too.
  ASSERT_EQ(beat(t + absl::Seconds(2), 0, 999, "aaaaaaaa", 50), ClusterRegistry::Beat::kAlive);
  ASSERT_EQ(beat(t + absl::Seconds(2), 0, 999, "cccccccc", 7), ClusterRegistry::Beat::kAlive);
  rpc::ClusterTimeline timeline = registry.Timeline(t + absl::Seconds(2), absl::Seconds(10));
  ASSERT_EQ(timeline.devices_size(), 2);
  EXPECT_EQ(timeline.window_us(), 10'000'000);
  EXPECT_EQ(timeline.devices(0).host(), "h:1");
  ASSERT_EQ(timeline.devices(0).buckets_size(), 1);
  const rpc::WorkBucket& first = timeline.devices(0).buckets(0);
  ASSERT_EQ(first.busy_size(), 2);
  EXPECT_EQ(first.busy(0).client_id(), "aaaaaaaa");
  EXPECT_EQ(first.busy(0).busy_micros(), 150);
  EXPECT_EQ(first.busy(1).busy_micros(), 7);
  ASSERT_EQ(timeline.devices(1).buckets_size(), 1);
  EXPECT_EQ(timeline.devices(1).buckets(0).busy(0).client_id(), "bbbbbbbb");  // a label, however long the name sent
  // A client's time beyond its bucket's width, a negative one, and a bucket dated far ahead: the
  // first two are clamped, the third is not kept.
  ASSERT_EQ(beat(t + absl::Seconds(2), 1, 1001, "dddddddd", 5'000'000), ClusterRegistry::Beat::kAlive);
  ASSERT_EQ(beat(t + absl::Seconds(2), 1, 1001, "eeeeeeee", -5), ClusterRegistry::Beat::kAlive);
  ASSERT_EQ(beat(t + absl::Seconds(2), 1, 5000, "aaaaaaaa", 1), ClusterRegistry::Beat::kAlive);
  timeline = registry.Timeline(t + absl::Seconds(2), absl::Hours(2));
  ASSERT_EQ(timeline.devices(1).buckets_size(), 1);
  EXPECT_EQ(timeline.devices(1).buckets(0).busy(1).busy_micros(), 1'000'000);
  EXPECT_EQ(timeline.devices(1).buckets(0).busy(2).busy_micros(), 0);
  // A window that ends after device 0's work leaves it out.
  EXPECT_EQ(registry.Timeline(t + absl::Seconds(2), absl::Seconds(1)).devices(0).buckets_size(), 0);

  // What is kept is the last kTimelineKept (30 s): a heartbeat drops what is older, and buckets
  // stay in time order whatever order they come in.
  for (int i = 39; i >= 0; --i) ASSERT_EQ(beat(t + absl::Seconds(39), 1, 1000 + i, "aaaaaaaa", 1), ClusterRegistry::Beat::kAlive);
  rpc::ClusterTimeline kept = registry.Timeline(t + absl::Seconds(39), absl::Seconds(60));
  ASSERT_EQ(kept.devices(1).buckets_size(), 32);  // those ending at 1009 s or later
  EXPECT_EQ(kept.devices(1).buckets(0).start_us(), 1008'000'000);
  for (int i = 1; i < 32; ++i) {
    EXPECT_LT(kept.devices(1).buckets(i - 1).start_us(), kept.devices(1).buckets(i).start_us());
  }
}

TEST(ClusterRegistryTest, ARegistrationsTimelineIsNotKept) {
  ClusterRegistry registry(absl::Seconds(3));
  rpc::RegisterWorkerRequest r = Worker("h:1", 0, 1);
  rpc::WorkBucket* b = r.mutable_devices(0)->add_recent_work();
  b->set_start_us(0);
  b->set_end_us(100);
  ASSERT_TRUE(registry.RegisterWorker(r, absl::UnixEpoch()).ok());
  EXPECT_EQ(registry.Status(absl::UnixEpoch()).hosts(0).devices(0).recent_work_size(), 0);
}

TEST(ClusterRegistryTest, HostsWithoutHeartbeatAreNotUsed) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  auto a = registry.RegisterWorker(Worker("h:1", 0, 4), t);
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 4), t).ok());
  rpc::HeartbeatRequest hb;
  hb.set_host_id(a->host_id());
  hb.set_address("h:1");
  rpc::DeviceInfo* d = hb.add_devices();
  d->set_local_index(1);
  d->set_busy_micros(300);
  rpc::ClientTime* share = d->add_client_time();
  share->set_client_id("alice");
  share->set_busy_micros(250);
  EXPECT_EQ(registry.Heartbeat(hb, t + absl::Seconds(2)), ClusterRegistry::Beat::kAlive);
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
  EXPECT_EQ(registry.Heartbeat(unknown, later), ClusterRegistry::Beat::kUnknown);
  // h:2 comes back after being declared dead: it is not revived.
  rpc::HeartbeatRequest back;
  back.set_host_id(a->host_id() + 1);
  back.set_address("h:2");
  EXPECT_EQ(registry.Heartbeat(back, later), ClusterRegistry::Beat::kExpired);
  EXPECT_FALSE(registry.Status(later).hosts(1).alive());
}

// A controller that was itself away (frozen, starved of CPU) past the heartbeat timeout does not
// judge hosts by the silence it could not have heard: each host keeps the silence it had when the
// controller went away, whether it is judged before the liveness loop wakes again or after. A
// host already silent past the timeout then stays departed.
TEST(ClusterRegistryTest, AControllerThatWasAwayDoesNotJudgeHostsByThatSilence) {
  ClusterRegistry registry(absl::Seconds(3));
  const absl::Time t = absl::UnixEpoch();
  auto fresh = registry.RegisterWorker(Worker("h:1", 0, 4), t + absl::Seconds(10));
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 4), t).ok());                    // silent since t
  for (int ms = 0; ms <= 10000; ms += 100) registry.Awake(t + absl::Milliseconds(ms));  // the loop ticks
  ASSERT_EQ(registry.LiveHosts(t + absl::Seconds(10)).size(), 1u);                      // h:2 is departed
  rpc::HeartbeatRequest hb;
  hb.set_host_id(fresh->host_id());
  hb.set_address("h:1");
  // Heard after the loop's last wake, just before the controller went away.
  ASSERT_EQ(registry.Heartbeat(hb, t + absl::Milliseconds(10050)), ClusterRegistry::Beat::kAlive);
  // The controller is away 20 s. Judged as it wakes, before its loop does, and after: h:1 lives
  // on, with the 50 ms of silence it had when the controller went.
  const absl::Time back = t + absl::Seconds(30);
  EXPECT_EQ(registry.LiveHosts(back).size(), 1u);
  registry.Awake(back);
  std::vector<ClusterRegistry::LiveHost> live = registry.LiveHosts(back + absl::Seconds(1));
  ASSERT_EQ(live.size(), 1u);
  EXPECT_EQ(live[0].address, "h:1");
  // Credited once, not again: a host that is silent from then on departs at the timeout (3 s
  // after the 50 ms it had).
  for (int ms = 100; ms <= 2900; ms += 100) registry.Awake(back + absl::Milliseconds(ms));
  EXPECT_EQ(registry.LiveHosts(back + absl::Milliseconds(2900)).size(), 1u);
  registry.Awake(back + absl::Milliseconds(3000));
  registry.Awake(back + absl::Milliseconds(3100));
  EXPECT_TRUE(registry.LiveHosts(back + absl::Milliseconds(3100)).empty());
}

TEST(ClusterRegistryTest, SlicesOnDepartedOrRestartedHostsAreLostAndRemapOntoLiveOnes) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest h1 = Worker("h:1", 0, 2), h2 = Worker("h:2", 0, 2);
  h1.set_incarnation("first");
  ASSERT_TRUE(registry.RegisterWorker(h1, t).ok());
  ASSERT_TRUE(registry.RegisterWorker(h2, t).ok());
  rpc::AllocateSliceRequest request = Slice({2});
  request.set_client_id("c");
  auto on_h1 = registry.AllocateSlice(request, t);  // least loaded first: h:1's devices
  auto on_h2 = registry.AllocateSlice(request, t);
  ASSERT_TRUE(on_h1.ok() && on_h2.ok());
  ASSERT_EQ(on_h2->devices(0).host_address(), "h:2");
  EXPECT_EQ(registry.SliceStates("c", t).slices_size(), 2);
  EXPECT_EQ(registry.SliceStates("other", t).slices_size(), 0);

  // h:2 stops heartbeating: its slice is lost, with the reason.
  rpc::HeartbeatRequest beat;
  beat.set_host_id(0);
  beat.set_address("h:1");
  beat.set_incarnation("first");
  const absl::Time later = t + absl::Seconds(5);
  // h:1 (host 0) is still there.
  ASSERT_EQ(registry.Heartbeat(beat, t + absl::Seconds(2)), ClusterRegistry::Beat::kAlive);
  ASSERT_EQ(registry.Heartbeat(beat, later), ClusterRegistry::Beat::kAlive);
  rpc::SliceStatesResponse states = registry.SliceStates("c", later);
  ASSERT_EQ(states.slices_size(), 2);
  EXPECT_FALSE(states.slices(0).lost());
  EXPECT_TRUE(states.slices(1).lost());
  EXPECT_NE(states.slices(1).reason().find("h:2 stopped heartbeating"), std::string::npos) << states.slices(1).reason();

  // Remapped, it keeps its id and lands on live devices; only its owner can remap it.
  rpc::RemapSliceRequest remap;
  remap.set_client_id("c");
  remap.set_slice_id(on_h2->slice_id());
  auto moved = registry.RemapSlice(remap, later);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->slice_id(), on_h2->slice_id());
  for (const auto& d : moved->devices()) EXPECT_EQ(d.host_address(), "h:1");
  EXPECT_FALSE(registry.SliceStates("c", later).slices(1).lost());
  remap.set_client_id("other");
  EXPECT_EQ(registry.RemapSlice(remap, later).status().code(), absl::StatusCode::kNotFound);

  // h:1 restarts (a new incarnation at the same address) once the old process is silent:
  // everything on it is lost.
  h1.set_incarnation("second");
  const absl::Time restart = later + absl::Seconds(4);
  ASSERT_TRUE(registry.RegisterWorker(h1, restart).ok());
  states = registry.SliceStates("c", restart);
  EXPECT_TRUE(states.slices(0).lost());
  EXPECT_NE(states.slices(0).reason().find("restarted"), std::string::npos);
}

// Host ids start again in a controller that restarted: a worker that registered first there may
// hold the id another worker still sends. That one's heartbeats are not taken for the other's
// (they kept it looking registered while the controller knew nothing of it); it is told to
// register, and gets an id of its own.
TEST(ClusterRegistryTest, AHeartbeatUnderAnotherWorkersIdIsToldToRegister) {
  ClusterRegistry registry(absl::Seconds(3));
  const absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest first = Worker("h:1", 0, 1);
  first.set_incarnation("one");
  auto registered = registry.RegisterWorker(first, t);
  ASSERT_TRUE(registered.ok());
  rpc::HeartbeatRequest stale;
  stale.set_host_id(registered->host_id());  // the id h:2 had under the previous controller
  stale.set_address("h:2");
  stale.set_incarnation("two");
  stale.add_devices()->set_memory_used(12345);
  EXPECT_EQ(registry.Heartbeat(stale, t + absl::Seconds(1)), ClusterRegistry::Beat::kUnknown);
  // The right address from another process: a newer one took the address, so this one leaves.
  stale.set_address("h:1");
  EXPECT_EQ(registry.Heartbeat(stale, t + absl::Seconds(1)), ClusterRegistry::Beat::kExpired);
  EXPECT_EQ(registry.Status(t + absl::Seconds(1)).hosts(0).devices(0).memory_used(), 0);
  rpc::RegisterWorkerRequest second = Worker("h:2", 0, 1);
  second.set_incarnation("two");
  auto own = registry.RegisterWorker(second, t + absl::Seconds(1));
  ASSERT_TRUE(own.ok());
  EXPECT_NE(own->host_id(), registered->host_id());
}

TEST(ClusterRegistryTest, ASecondWorkerCannotTakeOverALiveWorkersAddress) {
  ClusterRegistry registry(absl::Seconds(3));
  const absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest first = Worker("h:1", 0, 2), second = Worker("h:1", 0, 2);
  first.set_incarnation("first");
  second.set_incarnation("second");
  auto registered = registry.RegisterWorker(first, t);
  ASSERT_TRUE(registered.ok());
  auto refused = registry.RegisterWorker(second, t + absl::Seconds(1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_NE(refused.status().message().find("h:1"), std::string::npos);
  // The live one re-registers freely (a restarted controller asks it to), and keeps its id.
  auto again = registry.RegisterWorker(first, t + absl::Seconds(2));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->host_id(), registered->host_id());
  // Once it has been silent for the heartbeat timeout, the address is free.
  EXPECT_TRUE(registry.RegisterWorker(second, t + absl::Seconds(6)).ok());
}

// A client may name in its runs the hosts its slices were ever placed on (remapped ones too), and
// those that said they hold its data when they registered; no other host. Forgetting a departed
// client takes both away and frees the devices of its load.
TEST(ClusterRegistryTest, AClientMayUseOnlyTheHostsOfItsSlices) {
  ClusterRegistry registry(absl::Seconds(3));
  absl::Time t = absl::UnixEpoch();
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:1", 0, 2), t).ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:2", 0, 2), t).ok());
  ASSERT_TRUE(registry.RegisterWorker(Worker("h:3", 1, 2), t).ok());
  rpc::AllocateSliceRequest mine = Slice({2}, 0);
  mine.set_client_id("a");
  auto placed = registry.AllocateSlice(mine, t);  // h:1's devices
  ASSERT_TRUE(placed.ok()) << placed.status();
  ASSERT_EQ(placed->devices(0).host_address(), "h:1");
  EXPECT_TRUE(registry.CheckClientMayUse("a", "h:1").ok());
  const absl::Status other = registry.CheckClientMayUse("a", "h:2");
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
  EXPECT_NE(other.message().find("has no slice"), std::string::npos) << other;
  EXPECT_EQ(registry.CheckClientMayUse("b", "h:1").code(), absl::StatusCode::kPermissionDenied);
  // h:1 goes silent and the slice moves to h:2; h:1 stays usable (arrays placed there live on).
  const absl::Time later = t + absl::Seconds(5);
  rpc::HeartbeatRequest beat;
  for (int32_t host : {1, 2}) {
    beat.set_host_id(host);
    beat.set_address(absl::StrCat("h:", host + 1));
    registry.Heartbeat(beat, t + absl::Seconds(2));
    registry.Heartbeat(beat, later);
  }
  rpc::RemapSliceRequest remap;
  remap.set_client_id("a");
  remap.set_slice_id(placed->slice_id());
  auto moved = registry.RemapSlice(remap, later);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(registry.CheckClientMayUse("a", "h:2").ok());
  EXPECT_TRUE(registry.CheckClientMayUse("a", "h:1").ok());
  EXPECT_FALSE(registry.CheckClientMayUse("a", "h:3").ok());
  // A host that says it holds b's data (re-registering with a restarted controller).
  registry.NoteClientOnHost("b", "h:3");
  EXPECT_TRUE(registry.CheckClientMayUse("b", "h:3").ok());
  registry.ForgetClient("a");
  EXPECT_FALSE(registry.CheckClientMayUse("a", "h:1").ok());
  EXPECT_EQ(registry.SliceStates("a", later).slices_size(), 0);
}


}  // namespace
}  // namespace pathways
