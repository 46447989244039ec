#include "controller/run_groups.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/controller_client.h"

namespace pathways {
namespace {

struct Place {
  std::string host;
  int64_t seq;
  int64_t session;
};

// A run of group `group`, epoch `epoch`, number `k`, naming `hosts` (none: follows run k - 1).
rpc::GangRun GroupRun(int64_t group, int64_t epoch, int64_t k, const std::vector<Place>& hosts = {}) {
  rpc::GangRun run;
  run.set_group(group);
  run.set_group_epoch(epoch);
  run.set_group_run(k);
  run.mutable_run()->set_run_id(k);
  for (const Place& p : hosts) {
    rpc::HostSeq* h = run.add_hosts();
    h->set_host(p.host);
    h->set_seq(p.seq);
    h->set_session(p.session);
  }
  return run;
}

rpc::ScheduleRequest Request(const std::string& client, std::vector<rpc::GangRun> runs) {
  rpc::ScheduleRequest r;
  r.set_client_id(client);
  for (rpc::GangRun& run : runs) *r.add_runs() = std::move(run);
  return r;
}

std::vector<Place> Hosts(const rpc::GangRun& run) {
  std::vector<Place> out;
  for (const rpc::HostSeq& h : run.hosts()) out.push_back({h.host(), h.seq(), h.session()});
  return out;
}

void ExpectPlaces(const rpc::GangRun& run, const std::vector<Place>& want) {
  const std::vector<Place> got = Hosts(run);
  ASSERT_EQ(got.size(), want.size()) << run.DebugString();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].host, want[i].host);
    EXPECT_EQ(got[i].seq, want[i].seq) << got[i].host;
    EXPECT_EQ(got[i].session, want[i].session) << got[i].host;
  }
}

TEST(RunGroupBookTest, RunsThatNameNoHostTakeTheNextPlaceOnEachHostOfTheirEpoch) {
  RunGroupBook book;
  // Run 0 names a:5 and b:9 (the hosts had other ops of the client before); runs 1 and 2 follow.
  rpc::ScheduleRequest first = Request("c", {GroupRun(7, 1, 0, {{"a", 5, 11}, {"b", 9, 22}}), GroupRun(7, 1, 1)});
  ASSERT_TRUE(book.Resolve(first).ok());
  ExpectPlaces(first.runs(0), {{"a", 5, 11}, {"b", 9, 22}});
  ExpectPlaces(first.runs(1), {{"a", 6, 11}, {"b", 10, 22}});
  rpc::ScheduleRequest next = Request("c", {GroupRun(7, 1, 2), GroupRun(7, 1, 3)});
  ASSERT_TRUE(book.Resolve(next).ok());
  ExpectPlaces(next.runs(0), {{"a", 7, 11}, {"b", 11, 22}});
  ExpectPlaces(next.runs(1), {{"a", 8, 11}, {"b", 12, 22}});
  EXPECT_EQ(next.runs(1).run().run_id(), 3);  // the run itself is untouched
  EXPECT_EQ(book.bytes_kept(), 2 * (1 + RunGroupBook::kHostOverheadBytes));
}

TEST(RunGroupBookTest, ARunOutOfStepRefusesTheWholeRequestAndRecordsNothing) {
  RunGroupBook book;
  rpc::ScheduleRequest start = Request("c", {GroupRun(1, 1, 0, {{"a", 1, 5}})});
  ASSERT_TRUE(book.Resolve(start).ok());
  // Unknown group, another epoch, a run skipped, another client: each out of step.
  for (rpc::ScheduleRequest bad : {Request("c", {GroupRun(2, 1, 1)}), Request("c", {GroupRun(1, 2, 1)}),
                                   Request("c", {GroupRun(1, 1, 1), GroupRun(1, 1, 3)}), Request("d", {GroupRun(1, 1, 1)})}) {
    const absl::Status s = book.Resolve(bad);
    EXPECT_TRUE(IsRunGroupOutOfStep(s)) << s;
    EXPECT_NE(s.message().find("group"), std::string::npos) << s;
  }
  EXPECT_FALSE(IsRunGroupOutOfStep(absl::AbortedError("something else")));
  EXPECT_FALSE(IsRunGroupOutOfStep(absl::OkStatus()));
  // The refused requests changed nothing: run 1 still follows run 0.
  rpc::ScheduleRequest next = Request("c", {GroupRun(1, 1, 1)});
  ASSERT_TRUE(book.Resolve(next).ok());
  ExpectPlaces(next.runs(0), {{"a", 2, 5}});
}

TEST(RunGroupBookTest, ARunThatNamesItsHostsRestatesItsEpochAndAnOlderEpochsDoesNot) {
  RunGroupBook book;
  // Sent again naming its hosts (the controller did not know the epoch): run 4 at a:20.
  rpc::ScheduleRequest again = Request("c", {GroupRun(3, 2, 4, {{"a", 20, 1}}), GroupRun(3, 2, 5)});
  ASSERT_TRUE(book.Resolve(again).ok());
  ExpectPlaces(again.runs(1), {{"a", 21, 1}});
  // A run of the epoch before, naming its hosts, keeps them and leaves epoch 2 as it is.
  rpc::ScheduleRequest older = Request("c", {GroupRun(3, 1, 9, {{"a", 3, 1}}), GroupRun(3, 2, 6)});
  ASSERT_TRUE(book.Resolve(older).ok());
  ExpectPlaces(older.runs(0), {{"a", 3, 1}});
  ExpectPlaces(older.runs(1), {{"a", 22, 1}});
  // A new epoch (the client put an op on a host in between) starts over.
  rpc::ScheduleRequest epoch3 = Request("c", {GroupRun(3, 3, 0, {{"a", 24, 1}}), GroupRun(3, 3, 1)});
  ASSERT_TRUE(book.Resolve(epoch3).ok());
  ExpectPlaces(epoch3.runs(1), {{"a", 25, 1}});
}

TEST(RunGroupBookTest, ForgottenGroupsAreOutOfStepAndTheLeastRecentlyUsedGoesFirst) {
  RunGroupBook book;
  const int64_t n = static_cast<int64_t>(RunGroupBook::kMaxGroupsPerClient);
  for (int64_t g = 1; g <= n + 1; ++g) {
    rpc::ScheduleRequest r = Request("c", {GroupRun(g, 1, 0, {{"a", g, 1}, {"b", g, 1}})});
    ASSERT_TRUE(book.Resolve(r).ok());
    if (g == 2) {
      rpc::ScheduleRequest again = Request("c", {GroupRun(1, 1, 1)});  // group 1 used again: 2 is now the oldest
      ASSERT_TRUE(book.Resolve(again).ok());
    }
  }
  EXPECT_EQ(book.bytes_kept(), static_cast<size_t>(2 * n) * (1 + RunGroupBook::kHostOverheadBytes));
  rpc::ScheduleRequest two = Request("c", {GroupRun(2, 1, 1)});
  EXPECT_TRUE(IsRunGroupOutOfStep(book.Resolve(two)));
  rpc::ScheduleRequest one = Request("c", {GroupRun(1, 1, 2)});
  EXPECT_TRUE(book.Resolve(one).ok());
  book.Forget("c");
  EXPECT_EQ(book.bytes_kept(), 0u);
  rpc::ScheduleRequest after = Request("c", {GroupRun(1, 1, 3)});
  EXPECT_TRUE(IsRunGroupOutOfStep(book.Resolve(after)));
}

TEST(RunGroupBookTest, WhatAllClientsKeepIsBoundedInBytes) {
  RunGroupBook book;
  rpc::ScheduleRequest small = Request("c", {GroupRun(1, 1, 0, {{"a", 1, 1}})});
  ASSERT_TRUE(book.Resolve(small).ok());
  // Another client's group past the bound on its own: the least recently used go, the other
  // client's first, then this one, and the book keeps nothing past its bound.
  rpc::ScheduleRequest huge = Request("d", {GroupRun(1, 1, 0, {{std::string(RunGroupBook::kMaxBytesKept, 'h'), 1, 1}})});
  ASSERT_TRUE(book.Resolve(huge).ok());
  EXPECT_EQ(huge.runs(0).hosts_size(), 1);
  EXPECT_EQ(book.bytes_kept(), 0u);
  rpc::ScheduleRequest next = Request("c", {GroupRun(1, 1, 1)});
  EXPECT_TRUE(IsRunGroupOutOfStep(book.Resolve(next)));
}

TEST(RunGroupBookTest, ARequestMayNotNameMoreThanItsBoundOfHosts) {
  RunGroupBook book;
  std::vector<Place> hosts;
  for (int i = 0; i < 1 << 12; ++i) hosts.push_back({"h" + std::to_string(i), 1, 1});
  rpc::ScheduleRequest start = Request("c", {GroupRun(1, 1, 0, hosts)});
  ASSERT_TRUE(book.Resolve(start).ok());
  // 100 runs of 4096 hosts each: past the 256 Ki hosts a request may come to name.
  std::vector<rpc::GangRun> runs;
  for (int k = 1; k <= 100; ++k) runs.push_back(GroupRun(1, 1, k));
  rpc::ScheduleRequest big = Request("c", runs);
  const absl::Status s = book.Resolve(big);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("fewer runs"), std::string::npos) << s;
  // Nothing recorded: run 1 still follows run 0.
  rpc::ScheduleRequest next = Request("c", {GroupRun(1, 1, 1)});
  ASSERT_TRUE(book.Resolve(next).ok());
  EXPECT_EQ(next.runs(0).hosts_size(), 1 << 12);
}

TEST(RunGroupBookTest, RunsWithoutAGroupAreLeftAsTheyAre) {
  RunGroupBook book;
  rpc::GangRun plain;
  plain.add_hosts()->set_host("a");
  rpc::ScheduleRequest r = Request("c", {plain});
  ASSERT_TRUE(book.Resolve(r).ok());
  EXPECT_EQ(r.runs(0).hosts_size(), 1);
  EXPECT_EQ(book.bytes_kept(), 0u);
}

}  // namespace
}  // namespace pathways
