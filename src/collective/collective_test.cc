#include "collective/collective.h"

#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collective/tcp_links.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

GangLayout Layout(std::vector<int64_t> dims, std::vector<std::string> names, std::vector<std::string> hosts) {
  GangLayout layout{std::move(dims), std::move(names), {}};
  for (size_t i = 0; i < hosts.size(); ++i) layout.members.push_back({hosts[i], DeviceId(static_cast<int64_t>(i))});
  return layout;
}

// Runs `body(shard)` on one thread per shard and returns each shard's status.
template <typename F>
std::vector<absl::Status> RunShards(int n, F body) {
  std::vector<absl::Status> results(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int s = 0; s < n; ++s) threads.emplace_back([&, s] { results[s] = body(s); });
  for (auto& t : threads) t.join();
  return results;
}

// Hosts in one process, each with its own hub and links, meeting through one store.
class Cluster {
 public:
  explicit Cluster(const std::vector<std::string>& hosts, absl::Duration timeout = absl::Seconds(10)) {
    auto store = std::make_shared<InMemoryKeyValueStore>();
    for (const std::string& h : hosts) {
      auto links = TcpLinks::Create(h, "127.0.0.1", store);
      EXPECT_TRUE(links.ok()) << links.status();
      EXPECT_TRUE((*links)->Publish().ok());  // as workers do when they start
      hubs_[h] = std::make_unique<CollectiveHub>(h, *std::move(links), timeout);
    }
  }
  CollectiveHub& hub(const std::string& h) { return *hubs_.at(h); }

 private:
  std::map<std::string, std::unique_ptr<CollectiveHub>> hubs_;
};

// Member m's input, exact in int32: distinct per member and element.
std::vector<int32_t> Input(int m, size_t count) {
  std::vector<int32_t> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = static_cast<int32_t>(m * 100000 + i % 50000);
  return v;
}

// What member `rank` of a group of `g` gets from `kind`, computed directly.
std::vector<int32_t> Expected(CollectiveKind kind, int g, int rank, size_t count, int root) {
  std::vector<int32_t> out;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      out.assign(count, 0);
      for (int m = 0; m < g; ++m) {
        auto in = Input(m, count);
        for (size_t i = 0; i < count; ++i) out[i] += in[i];
      }
      break;
    case CollectiveKind::kAllGather:
      for (int m = 0; m < g; ++m) {
        auto in = Input(m, count);
        out.insert(out.end(), in.begin(), in.end());
      }
      break;
    case CollectiveKind::kReduceScatter: {
      auto all = Expected(CollectiveKind::kAllReduce, g, rank, count, root);
      out.assign(all.begin() + rank * (count / g), all.begin() + (rank + 1) * (count / g));
      break;
    }
    case CollectiveKind::kAllToAll:
      for (int m = 0; m < g; ++m) {
        auto in = Input(m, count);
        out.insert(out.end(), in.begin() + rank * (count / g), in.begin() + (rank + 1) * (count / g));
      }
      break;
    case CollectiveKind::kBroadcast: out = Input(root, count); break;
    case CollectiveKind::kRoll: out = Input((rank - root % g + g) % g, count); break;  // shifted by `root`
  }
  return out;
}

size_t OutCount(CollectiveKind kind, int g, size_t count) {
  if (kind == CollectiveKind::kAllGather) return count * g;
  if (kind == CollectiveKind::kReduceScatter) return count / g;
  return count;
}

constexpr CollectiveKind kKinds[] = {CollectiveKind::kAllReduce, CollectiveKind::kAllGather,
                                     CollectiveKind::kReduceScatter, CollectiveKind::kAllToAll,
                                     CollectiveKind::kBroadcast, CollectiveKind::kRoll};

// Runs every collective over `axes` on every shard of `layout` (shard s on hub of its member's
// host) and checks each output against Expected.
void CheckEveryCollective(Cluster& cluster, const GangLayout& layout_value, const std::string& axes, size_t count,
                          const std::string& run) {
  auto layout = std::make_shared<const GangLayout>(layout_value);
  const int n = static_cast<int>(layout->members.size());
  for (CollectiveKind kind : kKinds) {
    SCOPED_TRACE(absl::StrCat(CollectiveName(kind), " over '", axes, "' of ", count, " elements"));
    std::vector<std::vector<int32_t>> outs(n);
    std::vector<Group> groups;
    for (int s = 0; s < n; ++s) groups.push_back(*GroupOf(*layout, s, axes));
    const int g = static_cast<int>(groups[0].shards.size());
    const int root = g - 1;
    auto results = RunShards(n, [&](int s) {
      const std::string client = absl::StrCat(run, CollectiveName(kind));
      ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, 0, 0}, s);
      const std::vector<int32_t> in = Input(groups[s].rank, count);
      outs[s].assign(OutCount(kind, g, count), -1);
      CollectiveCall call{kind, DType::kI32, ReduceOp::kSum, root, count, reinterpret_cast<const char*>(in.data()),
                          reinterpret_cast<char*>(outs[s].data()), /*shift=*/root};
      return shard.Run(axes, call);
    });
    for (int s = 0; s < n; ++s) {
      ASSERT_TRUE(results[s].ok()) << "shard " << s << ": " << results[s];
      EXPECT_EQ(outs[s], Expected(kind, g, groups[s].rank, count, root)) << "shard " << s;
    }
  }
}

TEST(CollectiveHubTest, EveryCollectiveAmongMembersOfOneHost) {
  Cluster cluster({"h"});
  GangLayout layout = Layout({4}, {"i"}, std::vector<std::string>(4, "h"));
  // Large calls are shared out among the members, in parts that need not be equal.
  for (size_t count : {size_t{4}, size_t{1} << 16, (size_t{1} << 17) + 12}) {
    CheckEveryCollective(cluster, layout, "i", count, "one");
  }
}

// Every execution of a program asks for the same groups: each is placed once per layout, shard
// and axes, and layouts still in use keep their placements when the hub's memory of them fills.
TEST(CollectiveHubTest, PlacesEachGroupOncePerLayoutShardAndAxes) {
  CollectiveHub hub("h", nullptr, absl::Seconds(1));
  auto layout = std::make_shared<const GangLayout>(Layout({2, 2}, {"j", "i"}, {"h", "h", "g", "g"}));
  absl::StatusOr<std::shared_ptr<const GroupPlacement>> first = hub.Placed(layout, 0, "j");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*first)->group.shards, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ((*first)->hosts, (std::vector<std::string>{"g", "h"}));
  EXPECT_EQ(*hub.Placed(layout, 0, "j"), *first);
  EXPECT_EQ(*hub.Placed(layout, 0, " j "), *first) << "one entry for every spelling of the same axes";
  EXPECT_NE(*hub.Placed(layout, 1, "j"), *first);
  EXPECT_NE(*hub.Placed(layout, 0, "i"), *first);
  EXPECT_NE(*hub.Placed(std::make_shared<const GangLayout>(*layout), 0, "j"), *first);
  EXPECT_EQ(hub.Placed(layout, 0, "k").status().code(), absl::StatusCode::kInvalidArgument);
  // Layouts dropped by everyone else, with several groups each, far more than the hub keeps.
  for (int n = 0; n < 3000; ++n) {
    auto dropped = std::make_shared<const GangLayout>(*layout);
    for (int64_t shard : {0, 1}) ASSERT_TRUE(hub.Placed(dropped, shard, "j").ok());
  }
  EXPECT_EQ(*hub.Placed(layout, 0, "j"), *first);
}

TEST(CollectiveHubTest, AMemberThatNeverComesTimesTheOthersOut) {
  CollectiveHub hub("h", nullptr, absl::Milliseconds(100));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, std::vector<std::string>(3, "h")));
  auto results = RunShards(2, [&](int s) {
    const std::string client = "run";
    ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
    float x = 1, y = 0;
    CollectiveCall call{CollectiveKind::kAllReduce, DType::kF32, ReduceOp::kSum, 0, 1,
                        reinterpret_cast<const char*>(&x), reinterpret_cast<char*>(&y)};
    absl::Status r = shard.Run("", call);
    EXPECT_EQ(shard.first_error().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_NE(r.message().find("all_reduce(f32[1], sum) over [i] (3 members)"), std::string::npos) << r;
    EXPECT_NE(r.message().find("2 of 3 members on host h met"), std::string::npos) << r;
    return r;
  });
  for (auto& r : results) EXPECT_EQ(r.code(), absl::StatusCode::kDeadlineExceeded) << r;
  // The meeting waits for the member that never came, until twice the timeout has passed: a
  // later call's meeting then drops it.
  EXPECT_EQ(hub.stats().meetings, 1);
  absl::SleepFor(absl::Milliseconds(250));  // past twice the timeout
  auto later = RunShards(3, [&](int s) {
    const std::string client = "run";
    ShardCollectives shard(hub, layout, {&client, 0, 1, 0}, s);
    float x = 1, y = 0;
    CollectiveCall call{
        CollectiveKind::kAllReduce, DType::kF32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x),
        reinterpret_cast<char*>(&y)};
    return shard.Run("", call);
  });
  for (auto& r : later) EXPECT_TRUE(r.ok()) << r;
  EXPECT_EQ(hub.stats().meetings, 0);
}

// Members inside a call are counted (hosts report it with their heartbeats) until they leave it.
TEST(CollectiveHubTest, MembersWaitingInACallAreCountedUntilTheyLeave) {
  CollectiveHub hub("h", nullptr, absl::Seconds(30));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, std::vector<std::string>(3, "h")));
  const std::string client = "run";
  std::vector<float> in = {1, 2, 3}, out(3, 0);
  auto member = [&](int s) {
    ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
    CollectiveCall call{CollectiveKind::kAllReduce, DType::kF32, ReduceOp::kSum, 0, 1,
                        reinterpret_cast<const char*>(&in[s]), reinterpret_cast<char*>(&out[s])};
    return shard.Run("", call);
  };
  absl::Status first, second;
  std::thread a([&] { first = member(0); });
  std::thread b([&] { second = member(1); });
  // Two of three have come: both wait for the third, however long it takes to see them there.
  for (absl::Time until = absl::Now() + absl::Seconds(20); hub.stats().in_progress < 2 && absl::Now() < until;) {
    std::this_thread::yield();
  }
  EXPECT_EQ(hub.stats().in_progress, 2);
  EXPECT_EQ(hub.stats().calls, 0);
  EXPECT_TRUE(member(2).ok());
  a.join();
  b.join();
  EXPECT_TRUE(first.ok() && second.ok()) << first << " " << second;
  EXPECT_EQ(hub.stats().in_progress, 0);
  EXPECT_EQ(hub.stats().calls, 3);
  EXPECT_EQ(out, std::vector<float>(3, 6));
}

// A shard that fails before its body's collectives (an input that failed: its client went away
// with blocks still in flight) withdraws: its group mates on the host fail at once naming it,
// whether they were already waiting or come after, instead of holding their devices for the
// timeout (30 s in workers; here 60 s, so that a test that waited for it would time out). Calls
// it had already joined, other groups and other executions are not touched.
TEST(CollectiveHubTest, AWithdrawnMemberFailsItsMatesAtOnceWhetherTheyWaitOrComeLater) {
  CollectiveHub hub("h", nullptr, absl::Seconds(60));
  // Two groups over "i": shards {0, 1} (j=0) and {2, 3} (j=1).
  auto layout = std::make_shared<const GangLayout>(Layout({2, 2}, {"j", "i"}, std::vector<std::string>(4, "h")));
  const std::string client = "c";
  const absl::Time start = absl::Now();
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  auto call_of = [&](int s) {
    return CollectiveCall{
        CollectiveKind::kAllReduce,    DType::kF32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x[s]),
        reinterpret_cast<char*>(&y[s])};
  };
  const std::string execution = ShardCollectives::ExecutionKey({&client, 7, 1, 2});
  EXPECT_EQ(execution, "c/7/1/2");
  // Shard 0 waits; shard 1 then withdraws. Shards 2 and 3 (the other group) meet as usual.
  absl::Status waited;
  std::thread waiter([&] {
    ShardCollectives shard(hub, layout, {&client, 7, 1, 2}, 0);
    waited = shard.Run("i", call_of(0));
  });
  for (absl::Time until = absl::Now() + absl::Seconds(20); hub.stats().in_progress < 1 && absl::Now() < until;) {
    std::this_thread::yield();
  }
  hub.Withdraw(layout, execution, 1, 0, absl::CancelledError("input of 'f' (shard 1): client c went away"));
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
  EXPECT_NE(waited.message().find("shard 1 of this gang on host h will not come"), std::string::npos) << waited;
  EXPECT_NE(waited.message().find("client c went away"), std::string::npos) << waited;
  auto others = RunShards(2, [&](int s) {
    ShardCollectives shard(hub, layout, {&client, 7, 1, 2}, 2 + s);
    return shard.Run("i", call_of(2 + s));
  });
  for (const auto& r : others) EXPECT_TRUE(r.ok()) << r;
  EXPECT_EQ(y[2], 7);

  // A mate that comes after the withdrawal, to this call or a later one, fails at once too.
  ShardCollectives late(hub, layout, {&client, 7, 1, 2}, 0);
  absl::Status second = late.Run("i", call_of(0));
  EXPECT_EQ(second.code(), absl::StatusCode::kCancelled) << second;
  // Another run of the same node is another execution.
  auto next_run = RunShards(2, [&](int s) {
    ShardCollectives shard(hub, layout, {&client, 7, 2, 2}, s);
    return shard.Run("i", call_of(s));
  });
  for (const auto& r : next_run) EXPECT_TRUE(r.ok()) << r;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));  // nobody waited for the timeout
}

// A shard that withdraws after a call it joined (its body failed later) leaves that call alone:
// the meeting it came to completes, and only the calls after it fail.
TEST(CollectiveHubTest, AMemberThatWithdrawsAfterACallLeavesThatCallAlone) {
  CollectiveHub hub("h", nullptr, absl::Seconds(60));
  auto layout = std::make_shared<const GangLayout>(Layout({2}, {"i"}, std::vector<std::string>(2, "h")));
  const std::string client = "c";
  float x[2] = {1, 2}, y[2] = {};
  auto results = RunShards(2, [&](int s) -> absl::Status {
    ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
    CollectiveCall call{
        CollectiveKind::kAllReduce,    DType::kF32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x[s]),
        reinterpret_cast<char*>(&y[s])};
    PW_RETURN_IF_ERROR(shard.Run("", call));
    if (s == 1) {
      hub.Withdraw(layout, ShardCollectives::ExecutionKey({&client, 0, 0, 0}), 1, 1,
                   absl::InternalError("kernel failed"));
      return absl::OkStatus();
    }
    return shard.Run("", call);  // shard 1 never makes this second call
  });
  EXPECT_EQ(y[0], 3);
  EXPECT_TRUE(results[1].ok()) << results[1];
  EXPECT_EQ(results[0].code(), absl::StatusCode::kInternal) << results[0];
  EXPECT_NE(results[0].message().find("kernel failed"), std::string::npos) << results[0];
}

// Across hosts: host a's members are shard 0 and 1, host b's shard 2. In the gang's second run
// (the first connected the hosts, as earlier runs have in a worker), shard 1 withdraws; shard 0
// fails at once and tells host b, whose member fails within a moment, not at the timeout.
TEST(CollectiveHubTest, AWithdrawnMemberIsToldToTheGroupsOtherHosts) {
  Cluster cluster({"a", "b"}, absl::Seconds(60));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, {"a", "a", "b"}));
  const std::string client = "c";
  float x[3] = {1, 2, 3}, y[3] = {};
  auto run = [&](int64_t run_id, bool withdraw) {
    return RunShards(3, [&](int s) -> absl::Status {
      if (withdraw && s == 1) return absl::OkStatus();  // withdrawn: never calls
      ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, run_id, 0}, s);
      CollectiveCall call{
          CollectiveKind::kAllReduce,    DType::kF32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x[s]),
          reinterpret_cast<char*>(&y[s])};
      return shard.Run("", call);
    });
  };
  for (const auto& r : run(0, false)) ASSERT_TRUE(r.ok()) << r;
  const absl::Time start = absl::Now();
  cluster.hub("a").Withdraw(layout, ShardCollectives::ExecutionKey({&client, 0, 1, 0}), 1, 0,
                            absl::UnavailableError("input of 'f' (shard 1): its block never came"));
  auto results = run(1, true);
  EXPECT_EQ(results[0].code(), absl::StatusCode::kUnavailable) << results[0];
  EXPECT_FALSE(results[2].ok());
  EXPECT_NE(results[2].message().find("its block never came"), std::string::npos) << results[2];
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// A host whose every member of a group withdrew has no mate to tell the group's other hosts: they
// ask it once they have waited a while, and fail within a moment naming why, not at the timeout
// (60 s here). Calls the withdrawn member made before it failed are met as usual, and the next run
// on the same connections succeeds. Host b's shard withdraws: before any call in run 1 (a waits
// for b to dial it, c for b's messages); after its first call in run 2.
TEST(CollectiveHubTest, AHostWithNoMemberLeftInAGroupTellsItsOtherHostsWhenTheyAsk) {
  Cluster cluster({"a", "b", "c"}, absl::Seconds(60));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, {"a", "b", "c"}));
  const std::string client = "c";
  // Each shard makes `calls` all_reduces; shard 1 withdraws after `b_calls` of them (-1: never).
  auto run = [&](int64_t run_id, int calls, int b_calls) {
    const std::string execution = ShardCollectives::ExecutionKey({&client, 0, run_id, 0});
    return RunShards(3, [&](int s) -> absl::Status {
      ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, run_id, 0}, s);
      for (int k = 0; k < calls; ++k) {
        if (s == 1 && k == b_calls) {
          cluster.hub("b").Withdraw(layout, execution, 1, k, absl::ResourceExhaustedError("device 1 is full"));
          return absl::OkStatus();
        }
        int32_t x = s + 1, y = 0;
        CollectiveCall call{
            CollectiveKind::kAllReduce, DType::kI32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x),
            reinterpret_cast<char*>(&y)};
        PW_RETURN_IF_ERROR(shard.Run("", call));
        if (y != 6) return absl::InternalError(absl::StrCat("call ", k, " reduced to ", y));
      }
      return absl::OkStatus();
    });
  };
  for (int attempt = 0; attempt < 2; ++attempt) {
    const absl::Time start = absl::Now();
    auto results = run(1 + attempt, 2, attempt);
    for (int s : {0, 2}) {
      EXPECT_EQ(results[s].code(), absl::StatusCode::kResourceExhausted) << results[s];
      EXPECT_NE(results[s].message().find("shard 1 of this gang on host b will not come"), std::string::npos)
          << results[s];
      EXPECT_NE(results[s].message().find("device 1 is full"), std::string::npos) << results[s];
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(20));
    for (const auto& r : run(10 + attempt, 2, -1)) EXPECT_TRUE(r.ok()) << r;
  }
}

// A client that went away (its host collected it: ClientGone) leaves no call of it waiting, though
// the timeout is 60 s: host a's leader, waiting across hosts for host b (which never started the
// run), ends within a moment, as does a member waiting for its mate on a (which of the two ends
// client c's call depends on how far its second member got; the wait across hosts alone is
// PeerMeshTest.AnExchangeWaitingForAPeerEndsOnceItsHostNoLongerWantsIt); later calls of the
// client on a fail at once; and another client's gang then meets.
TEST(CollectiveHubTest, CallsOfAClientThatWentAwayStopWaiting) {
  Cluster cluster({"a", "b"}, absl::Seconds(60));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, {"a", "a", "b"}));
  // Shards `callers` of `client`'s run `run_id` each make one all_reduce.
  auto run = [&](const std::string& client, int64_t run_id, const std::vector<int>& callers) {
    return RunShards(static_cast<int>(callers.size()), [&](int i) -> absl::Status {
      const int s = callers[i];
      ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, run_id, 0}, s);
      int32_t x = s + 1, y = 0;
      CollectiveCall call{
          CollectiveKind::kAllReduce, DType::kI32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x),
          reinterpret_cast<char*>(&y)};
      PW_RETURN_IF_ERROR(shard.Run("", call));
      return y == 6 ? absl::OkStatus() : absl::InternalError(absl::StrCat("reduced to ", y));
    });
  };
  for (const auto& r : run("c", 0, {0, 1, 2})) ASSERT_TRUE(r.ok()) << r;  // connected
  // Client c: both of a's members call, and their leader waits for b. Client d: one calls, and
  // waits for its mate.
  for (const auto& [client, callers] : {std::make_pair(std::string("c"), std::vector<int>{0, 1}),
                                        std::make_pair(std::string("d"), std::vector<int>{0})}) {
    SCOPED_TRACE(client);
    const absl::Time start = absl::Now();
    std::thread goes([&, client = client, waiting = static_cast<int64_t>(callers.size())] {
      for (const absl::Time until = absl::Now() + absl::Seconds(20);
           cluster.hub("a").stats().in_progress < waiting && absl::Now() < until;) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      cluster.hub("a").ClientGone(client, absl::CancelledError(absl::StrCat("client ", client, " went away")));
    });
    const std::vector<absl::Status> results = run(client, 1, callers);
    goes.join();
    for (const absl::Status& r : results) {
      EXPECT_TRUE(absl::IsCancelled(r)) << r;
      EXPECT_NE(r.message().find(absl::StrCat("client ", client, " went away")), std::string::npos) << r;
    }
    EXPECT_LT(absl::Now() - start, absl::Seconds(20)) << "the calls waited for their timeout";
    const absl::Time again = absl::Now();
    const std::vector<absl::Status> later = run(client, 2, {0});
    EXPECT_TRUE(absl::IsCancelled(later[0])) << later[0];
    EXPECT_LT(absl::Now() - again, absl::Seconds(1)) << "a later call waited";
  }
  for (const auto& r : run("e", 0, {0, 1, 2})) EXPECT_TRUE(r.ok()) << r;
}

// A run that failed on host b before any of its shards there was set up (its program never came):
// host a, in the run's all_reduce, sent b its message and waits. Another client's gang on the
// same devices then runs: b drops a's message of the run it never started instead of taking it
// for a later call's (which would fail the other client's call as "ordered differently"), and a,
// finding b's message of a later call, abandons the run; both then meet in the other client's
// call. Alone, a asks b, and fails with why, within a moment (the timeout is 60 s).
TEST(CollectiveHubTest, ARunAHostNeverStartedNeitherHoldsItsPeersNorFailsTheNextGang) {
  Cluster cluster({"a", "b"}, absl::Seconds(60));
  auto layout = std::make_shared<const GangLayout>(Layout({2}, {"i"}, {"a", "b"}));
  auto call = [&](int s, const std::string& client, int64_t run_id) -> absl::Status {
    ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, run_id, 0}, s);
    int32_t x = s + 1, y = 0;
    CollectiveCall c{CollectiveKind::kAllReduce, DType::kI32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x),
                     reinterpret_cast<char*>(&y)};
    PW_RETURN_IF_ERROR(shard.Run("", c));
    return y == 3 ? absl::OkStatus() : absl::InternalError(absl::StrCat("reduced to ", y));
  };
  for (const auto& r : RunShards(2, [&](int s) { return call(s, "c", 0); })) ASSERT_TRUE(r.ok()) << r;
  const absl::Time start = absl::Now();
  cluster.hub("b").RunNotStarted("c", 0, 1, absl::NotFoundError("program 0 is not registered on b"));
  absl::Status a_run, a_next, b_next;
  std::thread a([&] {
    a_run = call(0, "c", 1);
    a_next = call(0, "d", 0);
  });
  std::thread b([&] {
    for (const absl::Time until = absl::Now() + absl::Seconds(20);
         cluster.hub("a").stats().in_progress == 0 && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    b_next = call(1, "d", 0);
  });
  a.join();
  b.join();
  EXPECT_FALSE(a_run.ok());
  EXPECT_TRUE(a_next.ok()) << a_next;
  EXPECT_TRUE(b_next.ok()) << b_next;

  // Alone: a asks b, which says why.
  cluster.hub("b").RunNotStarted("c", 0, 2, absl::NotFoundError("program 0 is not registered on b"));
  const absl::Status alone = call(0, "c", 2);
  EXPECT_TRUE(absl::IsNotFound(alone)) << alone;
  EXPECT_NE(alone.message().find("host b did not start the run (program 0 is not registered on b)"), std::string::npos)
      << alone;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30)) << "a waited for its timeout";
  for (const auto& r : RunShards(2, [&](int s) { return call(s, "e", 0); })) EXPECT_TRUE(r.ok()) << r;
}

// Two groups of one gang over the same devices (an axis of size 1: the group over "x" and the
// group over every axis hold the same members) share their connections; a body that goes from one
// to the other and back meets every time.
TEST(CollectiveHubTest, GroupsOverTheSameDevicesTakeTurnsOnTheirConnections) {
  Cluster cluster({"a", "b"});
  auto layout = std::make_shared<const GangLayout>(Layout({2, 1}, {"x", "y"}, {"a", "b"}));
  const std::string client = "c";
  auto results = RunShards(2, [&](int s) -> absl::Status {
    ShardCollectives shard(cluster.hub(layout->members[s].host), layout, {&client, 0, 0, 0}, s);
    for (const char* axes : {"x", "", "x", "", "x"}) {
      int32_t x = s + 1, y = 0;
      CollectiveCall call{
          CollectiveKind::kAllReduce, DType::kI32, ReduceOp::kSum, 0, 1, reinterpret_cast<const char*>(&x),
          reinterpret_cast<char*>(&y)};
      PW_RETURN_IF_ERROR(shard.Run(axes, call));
      if (y != 3) return absl::InternalError(absl::StrCat("over '", axes, "': ", y));
    }
    return absl::OkStatus();
  });
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r;
}

TEST(CollectiveHubTest, MembersThatDisagreeOnTheCallFailNamingBoth) {
  CollectiveHub hub("h", nullptr, absl::Seconds(10));
  auto layout = std::make_shared<const GangLayout>(Layout({2}, {"i"}, std::vector<std::string>(2, "h")));
  auto results = RunShards(2, [&](int s) {
    const std::string client = "run";
    ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
    std::vector<float> x(4, 1), y(4);
    CollectiveCall call{CollectiveKind::kAllReduce, DType::kF32, ReduceOp::kSum, 0, s == 0 ? 4u : 2u,
                        reinterpret_cast<const char*>(x.data()), reinterpret_cast<char*>(y.data())};
    return shard.Run("", call);
  });
  for (auto& r : results) {
    EXPECT_TRUE(absl::IsInvalidArgument(r)) << r;
    EXPECT_NE(r.message().find("all_reduce(f32[4], sum)"), std::string::npos) << r;
    EXPECT_NE(r.message().find("all_reduce(f32[2], sum)"), std::string::npos) << r;
    EXPECT_NE(r.message().find("over [i] (2 members)"), std::string::npos) << r;
  }
}

TEST(CollectiveHubTest, GroupsAcrossAndWithinTwoHosts) {
  // 2x2 mesh: row x=0 on host a, row x=1 on host b. Groups over x cross hosts (two of them at
  // once), groups over y stay on one host, the whole mesh spans both.
  Cluster cluster({"a", "b"});
  GangLayout layout = Layout({2, 2}, {"x", "y"}, {"a", "a", "b", "b"});
  for (size_t count : {size_t{4}, size_t{1} << 16}) {
    for (const char* axes : {"x", "y", ""}) CheckEveryCollective(cluster, layout, axes, count, "two");
  }
}

TEST(CollectiveHubTest, NineHostsHoldingUnevenInterleavedMembers) {
  // Enough hosts for small all_to_alls to relay blocks (Bruck), and large ones to swap directly.
  std::vector<std::string> hosts;
  for (int h = 0; h < 9; ++h) hosts.push_back(absl::StrCat("h", h));
  Cluster cluster(hosts);
  std::vector<std::string> members;
  for (int m = 0; m < 12; ++m) members.push_back(hosts[(m * 5) % 9]);  // 3 hosts hold two
  GangLayout layout = Layout({12}, {"i"}, members);
  for (size_t count : {size_t{12}, size_t{12} << 12}) CheckEveryCollective(cluster, layout, "i", count, "nine");
}

TEST(CollectiveHubTest, HostsHoldingUnevenInterleavedMembers) {
  // Six members over three hosts, 3/2/1 of them, not contiguous in rank order.
  Cluster cluster({"a", "b", "c"});
  GangLayout layout = Layout({6}, {"i"}, {"a", "b", "a", "c", "b", "a"});
  for (size_t count : {size_t{6}, size_t{6} << 15}) {
    for (int round = 0; round < 2; ++round) {
      CheckEveryCollective(cluster, layout, "i", count, absl::StrCat("uneven", round));
    }
  }
}

TEST(CollectiveHubTest, GangsOrderedDifferentlyOnTwoHostsFailThenTheHostsRecover) {
  Cluster cluster({"a", "b"}, absl::Seconds(2));
  auto layout = std::make_shared<const GangLayout>(Layout({2}, {"i"}, {"a", "b"}));
  auto all_reduce = [&](const std::string& gang, int s) {
    ShardCollectives shard(cluster.hub(s == 0 ? "a" : "b"), layout, {&gang, 0, 0, 0}, s);
    int32_t x = s + 1, y = 0;
    CollectiveCall call{CollectiveKind::kAllReduce, DType::kI32, ReduceOp::kSum, 0, 1,
                        reinterpret_cast<const char*>(&x), reinterpret_cast<char*>(&y)};
    absl::Status status = shard.Run("i", call);
    if (status.ok() && y != 3) status = absl::InternalError(absl::StrCat("sum ", y));
    return status;
  };
  // Host a runs gang P before Q; host b runs Q before P: each meets the other's gang and fails
  // it at once (Aborted) or sees the connection closed by the other (Unavailable).
  auto results = RunShards(2, [&](int s) {
    std::vector<std::string> order = s == 0 ? std::vector<std::string>{"P", "Q"} : std::vector<std::string>{"Q", "P"};
    absl::Status first = absl::OkStatus();
    for (const std::string& gang : order) {
      absl::Status r = all_reduce(gang, s);
      if (!r.ok() && first.ok()) first = r;
    }
    return first;
  });
  int aborted = 0;
  for (auto& r : results) {
    EXPECT_TRUE(absl::IsAborted(r) || absl::IsUnavailable(r)) << r;
    aborted += absl::IsAborted(r) ? 1 : 0;
  }
  EXPECT_GE(aborted, 1);
  // The same devices then run gangs in a consistent order.
  for (const char* gang : {"R", "S", "T"}) {
    auto again = RunShards(2, [&](int s) { return all_reduce(gang, s); });
    for (auto& r : again) EXPECT_TRUE(r.ok()) << r;
  }
}

}  // namespace
}  // namespace pathways::collective
