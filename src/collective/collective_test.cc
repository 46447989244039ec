#include "collective/collective.h"

#include <thread>

#include "collective/gloo_exchange.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

GangLayout Layout(std::vector<int64_t> dims, std::vector<std::string> names, std::vector<std::string> hosts) {
  GangLayout layout{std::move(dims), std::move(names), {}};
  for (size_t i = 0; i < hosts.size(); ++i) layout.members.push_back({hosts[i], static_cast<int32_t>(i)});
  return layout;
}

TEST(GroupOfTest, GroupsFollowTheNamedAxes) {
  GangLayout layout = Layout({2, 3}, {"x", "y"}, std::vector<std::string>(6, "h"));
  auto y = GroupOf(layout, 4, "y");  // shard 4 is at (1, 1)
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shards, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(y->rank, 1);
  auto x = GroupOf(layout, 4, "x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->shards, (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(x->rank, 1);
  EXPECT_NE(x->id, GroupOf(layout, 5, "x")->id);
  EXPECT_EQ(x->id, GroupOf(layout, 1, "x")->id);
  auto all = GroupOf(layout, 4, "");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->shards, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(all->rank, 4);
  auto yx = GroupOf(layout, 4, "y, x");  // y varies slowest
  ASSERT_TRUE(yx.ok());
  EXPECT_EQ(yx->shards, (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
  EXPECT_EQ(yx->rank, 3);
  EXPECT_EQ(GroupOf(layout, 0, "z").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GroupOf(layout, 0, "x,x").status().code(), absl::StatusCode::kInvalidArgument);
}

// Runs `body(shard)` on one thread per shard and returns each shard's result.
template <typename F>
std::vector<absl::StatusOr<Exchanged>> RunShards(int n, F body) {
  std::vector<absl::StatusOr<Exchanged>> results(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int s = 0; s < n; ++s) threads.emplace_back([&, s] { results[s] = body(s); });
  for (auto& t : threads) t.join();
  return results;
}

void ExpectParts(const absl::StatusOr<Exchanged>& r, const std::vector<std::string>& want, int rank) {
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, rank);
  ASSERT_EQ(r->parts.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(*r->parts[i], want[i]) << "part " << i;
}

TEST(CollectiveHubTest, MembersOnOneHostSeeEveryContributionInRankOrder) {
  CollectiveHub hub("h", nullptr, absl::Seconds(10));
  auto layout = std::make_shared<const GangLayout>(Layout({4}, {"i"}, std::vector<std::string>(4, "h")));
  for (int round = 0; round < 20; ++round) {
    auto results = RunShards(4, [&](int s) {
      const std::string client = absl::StrCat("run", round);
      ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
      return shard.Exchange("i", absl::StrCat("s", s));
    });
    for (int s = 0; s < 4; ++s) ExpectParts(results[s], {"s0", "s1", "s2", "s3"}, s);
  }
}

TEST(CollectiveHubTest, AMemberThatNeverComesTimesTheOthersOut) {
  CollectiveHub hub("h", nullptr, absl::Milliseconds(100));
  auto layout = std::make_shared<const GangLayout>(Layout({3}, {"i"}, std::vector<std::string>(3, "h")));
  auto results = RunShards(2, [&](int s) {
    const std::string client = "run";
    ShardCollectives shard(hub, layout, {&client, 0, 0, 0}, s);
    auto r = shard.Exchange("", "x");
    EXPECT_EQ(shard.first_error().code(), absl::StatusCode::kDeadlineExceeded);
    return r;
  });
  for (auto& r : results) EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
}

// Two hosts in one process, each with its own Gloo endpoint, meeting through one store.
class TwoHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = std::make_shared<InMemoryKeyValueStore>();
    for (const char* h : {"a", "b"}) {
      auto gloo = GlooExchange::Create("127.0.0.1", store);
      ASSERT_TRUE(gloo.ok()) << gloo.status();
      hubs_[h] = std::make_unique<CollectiveHub>(h, *std::move(gloo), absl::Seconds(2));
    }
  }
  CollectiveHub& hub(const std::string& h) { return *hubs_.at(h); }
  std::map<std::string, std::unique_ptr<CollectiveHub>> hubs_;
};

TEST_F(TwoHostTest, GroupsAcrossAndWithinHostsExchange) {
  // 2x2 mesh: row x=0 on host a, row x=1 on host b. Groups over x cross hosts (two of them at
  // once), groups over y stay on one host, the whole mesh spans both.
  auto layout = std::make_shared<const GangLayout>(Layout({2, 2}, {"x", "y"}, {"a", "a", "b", "b"}));
  for (int round = 0; round < 5; ++round) {
    auto results = RunShards(4, [&](int s) -> absl::StatusOr<Exchanged> {
      const std::string client = absl::StrCat("run", round);
      ShardCollectives shard(hub(s < 2 ? "a" : "b"), layout, {&client, 0, 0, 0}, s);
      auto over_x = shard.Exchange("x", absl::StrCat("x", s));
      if (!over_x.ok()) return over_x.status();
      const std::vector<std::string> want_x = s % 2 == 0 ? std::vector<std::string>{"x0", "x2"}
                                                          : std::vector<std::string>{"x1", "x3"};
      ExpectParts(over_x, want_x, s / 2);
      auto over_y = shard.Exchange("y", absl::StrCat("y", s));
      if (!over_y.ok()) return over_y.status();
      const std::vector<std::string> want_y = s < 2 ? std::vector<std::string>{"y0", "y1"}
                                                    : std::vector<std::string>{"y2", "y3"};
      ExpectParts(over_y, want_y, s % 2);
      return shard.Exchange("", std::string(3, static_cast<char>('0' + s)));
    });
    for (int s = 0; s < 4; ++s) ExpectParts(results[s], {"000", "111", "222", "333"}, s);
  }
}

TEST_F(TwoHostTest, GangsOrderedDifferentlyOnTwoHostsTimeOutThenTheHostsRecover) {
  auto layout = std::make_shared<const GangLayout>(Layout({2}, {"i"}, {"a", "b"}));
  // Host a runs gang P before Q; host b runs Q before P: each waits for the other.
  auto results = RunShards(2, [&](int s) -> absl::StatusOr<Exchanged> {
    CollectiveHub& h = hub(s == 0 ? "a" : "b");
    std::vector<std::string> order = s == 0 ? std::vector<std::string>{"P", "Q"} : std::vector<std::string>{"Q", "P"};
    absl::Status first = absl::OkStatus();
    for (const std::string& gang : order) {
      ShardCollectives shard(h, layout, {&gang, 0, 0, 0}, s);
      auto r = shard.Exchange("", "v");
      if (!r.ok() && first.ok()) first = r.status();
    }
    return first;
  });
  // Each fails: by its own timeout, or because the other side timed out first and closed the
  // connection (Unavailable); at least one of them timed out.
  int timed_out = 0;
  for (auto& r : results) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status())) << r.status();
    timed_out += absl::IsDeadlineExceeded(r.status()) ? 1 : 0;
  }
  EXPECT_GE(timed_out, 1);
  // The same devices then run a gang in a consistent order.
  auto again = RunShards(2, [&](int s) {
    const std::string client = "R";
    ShardCollectives shard(hub(s == 0 ? "a" : "b"), layout, {&client, 0, 0, 0}, s);
    return shard.Exchange("i", s == 0 ? "ra" : "rb");
  });
  for (int s = 0; s < 2; ++s) ExpectParts(again[s], {"ra", "rb"}, s);
}

}  // namespace
}  // namespace pathways::collective
