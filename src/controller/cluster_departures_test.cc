// How hosts leave the cluster registry beyond going silent: a host that says why it leaves, and
// one made to leave because another could not deliver to it (or the reporter, when it is the one
// cut off).
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "controller/cluster_registry.h"
#include "controller/registry_testing.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

using testing::Slice;
using testing::Worker;

// A host that says it leaves (a device stuck in a computation) is departed at once, not after the
// heartbeat timeout: slices on it are lost with its reason, status shows the reason, its later
// heartbeats are told it expired, and a new process may take its address at once.
TEST(ClusterRegistryTest, AHostThatSaysItLeavesIsDepartedAtOnceWithItsReason) {
  ClusterRegistry registry(absl::Seconds(3));
  const absl::Time t = absl::UnixEpoch();
  rpc::RegisterWorkerRequest stuck = Worker("h:1", 0, 2), fresh = Worker("h:1", 0, 2);
  stuck.set_incarnation("stuck");
  fresh.set_incarnation("fresh");
  auto registered = registry.RegisterWorker(stuck, t);
  ASSERT_TRUE(registered.ok());
  rpc::AllocateSliceRequest request = Slice({2});
  request.set_client_id("c");
  ASSERT_TRUE(registry.AllocateSlice(request, t).ok());

  rpc::HeartbeatRequest beat;
  beat.set_host_id(registered->host_id());
  beat.set_address("h:1");
  beat.set_incarnation("stuck");
  beat.set_leaving("device 0 is stuck in 'spin'");
  const absl::Time now = t + absl::Milliseconds(100);  // well within the heartbeat timeout
  EXPECT_EQ(registry.Heartbeat(beat, now), ClusterRegistry::Beat::kLeft);
  EXPECT_EQ(registry.Heartbeat(beat, now), ClusterRegistry::Beat::kExpired);  // said once
  EXPECT_EQ(registry.DepartedHosts(now),
            (std::vector<ClusterRegistry::Departed>{{"h:1", "device 0 is stuck in 'spin'"}}));
  EXPECT_TRUE(registry.LiveHosts(now).empty());
  rpc::SliceStatesResponse states = registry.SliceStates("c", now);
  ASSERT_EQ(states.slices_size(), 1);
  EXPECT_TRUE(states.slices(0).lost());
  EXPECT_NE(states.slices(0).reason().find("h:1 left: device 0 is stuck in 'spin'"), std::string::npos)
      << states.slices(0).reason();
  rpc::ClusterStatus status = registry.Status(now);
  ASSERT_EQ(status.hosts_size(), 1);
  EXPECT_FALSE(status.hosts(0).alive());
  EXPECT_EQ(status.hosts(0).left(), "device 0 is stuck in 'spin'");
  beat.clear_leaving();
  EXPECT_EQ(registry.Heartbeat(beat, now), ClusterRegistry::Beat::kExpired);

  // A host whose last word came after the heartbeat timeout (late, under load) keeps its reason.
  rpc::RegisterWorkerRequest late = Worker("h:2", 0, 1);
  late.set_incarnation("late");
  auto late_id = registry.RegisterWorker(late, t);
  ASSERT_TRUE(late_id.ok());
  rpc::HeartbeatRequest last;
  last.set_host_id(late_id->host_id());
  last.set_address("h:2");
  last.set_incarnation("late");
  last.set_leaving("device 0 is stuck in 'loop'");
  EXPECT_EQ(registry.Heartbeat(last, t + absl::Seconds(10)), ClusterRegistry::Beat::kLeft);
  EXPECT_EQ(registry.Status(t + absl::Seconds(10)).hosts(1).left(), "device 0 is stuck in 'loop'");

  // A supervisor's new process at the address registers at once, and serves.
  auto again = registry.RegisterWorker(fresh, now);
  ASSERT_TRUE(again.ok()) << again.status();
  beat.set_incarnation("fresh");
  beat.set_host_id(again->host_id());
  EXPECT_EQ(registry.Heartbeat(beat, now + absl::Milliseconds(100)), ClusterRegistry::Beat::kAlive);
  EXPECT_TRUE(registry.Status(now).hosts(0).left().empty());
}

// Three live hosts h:1, h:2, h:3 (incarnation "<address>/<n>") and their heartbeats.
struct ThreeHosts {
  ThreeHosts() {
    for (const std::string address : {"h:1", "h:2", "h:3"}) Register(address, 1);
  }
  void Register(const std::string& address, int n, absl::Duration after = absl::ZeroDuration()) {
    rpc::RegisterWorkerRequest r = Worker(address, 0, 1);
    r.set_incarnation(absl::StrCat(address, "/", n));
    auto registered = registry.RegisterWorker(r, t + after);
    ASSERT_TRUE(registered.ok());
    rpc::HeartbeatRequest& beat = beats[address];
    beat.Clear();
    beat.set_host_id(registered->host_id());
    beat.set_address(address);
    beat.set_incarnation(r.incarnation());
  }
  // `from`'s heartbeat naming `peers` as stalled for 15 s with 4096 bytes waiting.
  rpc::HeartbeatRequest Naming(const std::string& from, const std::vector<std::string>& peers) {
    rpc::HeartbeatRequest beat = beats[from];
    for (const std::string& address : peers) {
      rpc::UnreachablePeer* peer = beat.add_unreachable();
      peer->set_address(address);
      peer->set_stalled_ms(15000);
      peer->set_bytes(4096);
    }
    return beat;
  }
  ClusterRegistry registry{absl::Seconds(3)};
  const absl::Time t = absl::UnixEpoch();
  std::map<std::string, rpc::HeartbeatRequest> beats;
};

using Left = std::vector<std::string>;

// A host that could not deliver to one peer makes that peer leave, with the reason; the peer's own
// report of the reporter (a partition seen from both sides) changes nothing more, since it left.
// A host that then cannot deliver to another one either is itself the one cut off, and leaves.
TEST(ClusterRegistryTest, APeerNamedUnreachableLeavesUnlessTheReporterIsTheOneCutOff) {
  ThreeHosts hosts;
  ClusterRegistry& registry = hosts.registry;
  const absl::Time now = hosts.t + absl::Seconds(1);
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:1", {"h:9", "h:1"}), now), Left{});  // unknown, itself
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:1", {"h:2"}), now), Left{"h:2"});
  const std::string why = registry.WhyLeft(hosts.beats["h:2"]);
  EXPECT_NE(why.find("host h:1 could not deliver dataflow batches to h:2 for 15s (4096 bytes waiting)"),
            std::string::npos)
      << why;
  EXPECT_EQ(registry.Heartbeat(hosts.beats["h:2"], now), ClusterRegistry::Beat::kExpired);
  ASSERT_EQ(registry.DepartedHosts(now).size(), 1u);
  EXPECT_EQ(registry.DepartedHosts(now)[0].address, "h:2");
  EXPECT_EQ(registry.DepartedHosts(now)[0].why, why);
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:2", {"h:1"}), now), Left{});  // it left: its word counts no more
  EXPECT_EQ(registry.WhyLeft(hosts.beats["h:1"]), "");
  // h:1 reaches h:3 no better: h:1 is the one cut off.
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:1", {"h:3"}), now + absl::Seconds(2)), Left{"h:1"});
  EXPECT_NE(registry.WhyLeft(hosts.beats["h:1"]).find("this host is the one cut off"), std::string::npos);
  EXPECT_EQ(registry.WhyLeft(hosts.beats["h:3"]), "");
  EXPECT_EQ(registry.LiveHosts(now + absl::Seconds(2)).size(), 1u);
  // A host silent past the heartbeat timeout left for that alone: no reason beyond the silence.
  EXPECT_EQ(registry.Heartbeat(hosts.beats["h:3"], hosts.t + absl::Seconds(10)), ClusterRegistry::Beat::kExpired);
  EXPECT_EQ(registry.WhyLeft(hosts.beats["h:3"]), "");
}

// A host that names two live peers at once reaches neither: it alone leaves. A new process at a
// reporter's address starts with a clean record; a refused peer is named for that.
TEST(ClusterRegistryTest, AHostNamingTwoPeersIsTheOneCutOffAndANewProcessStartsAfresh) {
  ThreeHosts hosts;
  ClusterRegistry& registry = hosts.registry;
  const absl::Time now = hosts.t + absl::Seconds(1);
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:1", {"h:2", "h:3", "h:3"}), now), Left{"h:1"});
  const std::string why = registry.WhyLeft(hosts.beats["h:1"]);
  EXPECT_NE(why.find("it could not deliver dataflow batches to h:2 for 15s"), std::string::npos) << why;
  EXPECT_NE(why.find("this host is the one cut off"), std::string::npos) << why;
  EXPECT_EQ(registry.LiveHosts(now).size(), 2u);

  // h:1 comes back and makes h:2 leave, then goes silent; a new process at h:1 names h:3, which
  // leaves: the new process does not inherit the old one's record (which would make it the one
  // cut off, within the minute).
  hosts.Register("h:1", 2);
  EXPECT_EQ(registry.ReportUnreachable(hosts.Naming("h:1", {"h:2"}), now), Left{"h:2"});
  const absl::Time later = hosts.t + absl::Seconds(5);  // past h:1's heartbeat timeout
  EXPECT_EQ(registry.Heartbeat(hosts.beats["h:3"], hosts.t + absl::Seconds(3)), ClusterRegistry::Beat::kAlive);
  hosts.Register("h:1", 3, absl::Seconds(5));
  rpc::HeartbeatRequest refused = hosts.Naming("h:1", {"h:3"});
  refused.mutable_unreachable(0)->set_refused(true);
  EXPECT_EQ(registry.ReportUnreachable(refused, later), Left{"h:3"});
  EXPECT_NE(registry.WhyLeft(hosts.beats["h:3"]).find("host h:1 refused dataflow batches for h:3"), std::string::npos)
      << registry.WhyLeft(hosts.beats["h:3"]);
}

}  // namespace
}  // namespace pathways
