#include "controller/client_leases.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(ClientLeasesTest, LapsedAndDepartedClientsAreReportedOnce) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60));
  const absl::Time t = absl::UnixEpoch();
  leases.Renew("stays", t);
  leases.Renew("dies", t);
  leases.Renew("leaves", t);
  leases.Goodbye("leaves", t + absl::Seconds(1));
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(1)), std::vector<std::string>{"leaves"});
  leases.Renew("stays", t + absl::Seconds(3));
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(5)), std::vector<std::string>{"dies"});  // missed its lease
  leases.Renew("dies", t + absl::Seconds(6));  // too late: it stays departed, reported once
  EXPECT_TRUE(leases.TakeDeparted(t + absl::Seconds(6)).empty());
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(120)), std::vector<std::string>{"stays"});  // lapsed by now
}

// A controller that was itself away past the lease timeout (frozen, starved of CPU) does not
// retire its clients for the heartbeats it could not hear; a lease that had lapsed before it went
// away is retired all the same.
TEST(ClientLeasesTest, AControllerThatWasAwayDoesNotLetLeasesLapseForIt) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60));
  const absl::Time t = absl::UnixEpoch();
  leases.Renew("stays", t + absl::Seconds(9));
  leases.Renew("lapsed", t);
  std::vector<std::string> departed;
  for (int ms = 0; ms <= 10000; ms += 100) {
    leases.Awake(t + absl::Milliseconds(ms));
    for (std::string& c : leases.TakeDeparted(t + absl::Milliseconds(ms))) departed.push_back(std::move(c));
  }
  EXPECT_EQ(departed, std::vector<std::string>{"lapsed"});
  const absl::Time back = t + absl::Seconds(30);  // away 20 s
  leases.Awake(back);
  EXPECT_TRUE(leases.TakeDeparted(back).empty());
  leases.Renew("stays", back + absl::Milliseconds(100));  // its heartbeat, once it can be heard
  leases.Awake(back + absl::Milliseconds(200));
  EXPECT_TRUE(leases.TakeDeparted(back + absl::Milliseconds(200)).empty());
}

// A departed client's calls are told that it went away, when and why, for as long as it is
// remembered: a process resumed after a pause longer than its lease learns that what it held is
// gone, instead of failing on a slice it no longer has.
TEST(ClientLeasesTest, ADepartedClientsCallsSayItWentAwayAndWhy) {
  ClientLeases leases(absl::Seconds(3), absl::Minutes(10));
  const absl::Time t = absl::UnixEpoch();
  leases.Renew("paused", t);
  leases.Renew("leaves", t);
  leases.Renew("stays", t);
  leases.Goodbye("leaves", t + absl::Seconds(1));
  EXPECT_TRUE(leases.CheckNotRefused("paused", "", t + absl::Seconds(2)).ok());
  leases.Renew("stays", t + absl::Seconds(3));
  (void)leases.TakeDeparted(t + absl::Seconds(5));  // "paused" missed its lease
  leases.Renew("paused", t + absl::Seconds(65));    // resumed: its heartbeat does not bring it back

  const absl::Status paused = leases.CheckNotRefused("paused", "", t + absl::Seconds(65));
  EXPECT_EQ(paused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(paused.message().find("client paused went away 60 s ago"), std::string::npos) << paused;
  EXPECT_NE(paused.message().find("no heartbeat for 3s"), std::string::npos) << paused;
  EXPECT_NE(paused.message().find("connect again"), std::string::npos) << paused;
  const absl::Status left = leases.CheckNotRefused("leaves", "", t + absl::Seconds(6));
  EXPECT_EQ(left.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(left.message().find("said goodbye"), std::string::npos) << left;
  EXPECT_TRUE(leases.CheckNotRefused("stays", "", t + absl::Seconds(5)).ok());

  // Forgotten once the memory of it ends: an unknown client's calls are its own to fail.
  (void)leases.TakeDeparted(t + absl::Minutes(11));
  EXPECT_TRUE(leases.CheckNotRefused("paused", "", t + absl::Minutes(11)).ok());
}

// A flood of short-lived clients cannot grow the memory of departed ones without bound: past
// 65536, the longest gone are forgotten first.
TEST(ClientLeasesTest, DepartedClientsAreRememberedUpToABound) {
  ClientLeases leases(absl::Seconds(3), absl::Minutes(10));
  const absl::Time t = absl::UnixEpoch();
  const int n = (1 << 16) + 10;
  for (int i = 0; i < n; ++i) {
    const std::string client = absl::StrCat("c", i);
    leases.Renew(client, t);
    leases.Goodbye(client, t + absl::Milliseconds(i));
  }
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(70)).size(), static_cast<size_t>(n));  // each retired once
  const absl::Time now = t + absl::Seconds(70);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(leases.CheckNotRefused(absl::StrCat("c", i), "", now).ok()) << i;
  for (int i : {10, n - 1}) EXPECT_FALSE(leases.CheckNotRefused(absl::StrCat("c", i), "", now).ok()) << i;
}

TEST(ClientLeasesTest, ClientsThatHostsHoldAreAdoptedByARestartedController) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60));
  const absl::Time t = absl::UnixEpoch();
  leases.Renew("alive", t);
  leases.Adopt("alive", t + absl::Seconds(2));  // known: its own lease stands
  leases.Adopt("dead", t + absl::Seconds(2));   // unknown: a lease from now
  leases.Renew("alive", t + absl::Seconds(4));
  EXPECT_TRUE(leases.TakeDeparted(t + absl::Seconds(4)).empty());
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(6)), std::vector<std::string>{"dead"});  // never heard from
  leases.Adopt("dead", t + absl::Seconds(7));  // another host reports it late: still departed
  EXPECT_TRUE(leases.TakeDeparted(t + absl::Seconds(7)).empty());
}

TEST(ClientLeasesTest, ARefusedClientDepartsAtOnceAndIsRefusedLongerThanOthersAreRemembered) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60), absl::Hours(1));
  const absl::Time t = absl::UnixEpoch();
  leases.Renew("spinner", t);
  leases.Renew("other", t);
  EXPECT_TRUE(leases.CheckNotRefused("spinner").ok());
  leases.Refuse("spinner", "its computation 'spin' held device 0 of h:1 for 10s", t + absl::Seconds(1));
  EXPECT_EQ(leases.TakeDeparted(t + absl::Seconds(1)), std::vector<std::string>{"spinner"});  // retired now
  const absl::Status refused = leases.CheckNotRefused("spinner");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("'spin' held device 0 of h:1"), std::string::npos) << refused;
  EXPECT_TRUE(leases.CheckNotRefused("other").ok());
  leases.Renew("spinner", t + absl::Seconds(2));  // its heartbeats do not bring it back
  EXPECT_TRUE(leases.TakeDeparted(t + absl::Seconds(2)).empty());
  // Still refused after the minute other departed clients are remembered for; forgotten after the hour.
  (void)leases.TakeDeparted(t + absl::Minutes(30));
  EXPECT_FALSE(leases.CheckNotRefused("spinner").ok());
  (void)leases.TakeDeparted(t + absl::Minutes(62));
  EXPECT_TRUE(leases.CheckNotRefused("spinner").ok());
}

// A refused client of a named tenant takes its tenant with it: the tenant's other clients depart,
// and every call of the tenant (a client new or old) is refused for the hour; other tenants, and
// the unnamed tenant of the shared token, are not.
TEST(ClientLeasesTest, ARefusedClientOfANamedTenantTakesTheTenantWithIt) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60), absl::Hours(1));
  const absl::Time t = absl::UnixEpoch();
  for (const char* c : {"spinner", "sibling"}) {
    ASSERT_TRUE(leases.CheckNotRefused(c, "mallory", t).ok());
    leases.Renew(c, t);
  }
  ASSERT_TRUE(leases.CheckNotRefused("alice-1", "alice", t).ok());
  leases.Renew("alice-1", t);
  ASSERT_TRUE(leases.CheckNotRefused("shared-1", "", t).ok());
  leases.Renew("shared-1", t);
  EXPECT_EQ(leases.TenantOf("sibling"), "mallory");
  EXPECT_EQ(leases.TenantOf("shared-1"), "");
  leases.Refuse("spinner", "its computation 'spin' held device 0 of h:1 for 10s", t + absl::Seconds(1));
  std::vector<std::string> departed = leases.TakeDeparted(t + absl::Seconds(1));
  std::sort(departed.begin(), departed.end());
  EXPECT_EQ(departed, (std::vector<std::string>{"sibling", "spinner"}));
  for (const char* c : {"sibling", "newcomer"}) {
    const absl::Status refused = leases.CheckNotRefused(c, "mallory", t + absl::Seconds(2));
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << c;
    EXPECT_NE(refused.message().find("refuses tenant mallory"), std::string::npos) << refused;
    EXPECT_NE(refused.message().find("its client spinner was refused: its computation 'spin'"), std::string::npos)
        << refused;
  }
  EXPECT_FALSE(leases.CheckTenantNotRefused("mallory", t + absl::Seconds(2)).ok());
  EXPECT_EQ(leases.TenantRefusals(t + absl::Seconds(2)).size(), 1u);
  EXPECT_TRUE(leases.CheckNotRefused("alice-1", "alice", t + absl::Seconds(2)).ok());
  EXPECT_TRUE(leases.CheckTenantNotRefused("", t + absl::Seconds(2)).ok());
  // A refused client of the shared token is refused alone.
  leases.Refuse("shared-1", "stuck", t + absl::Seconds(2));
  EXPECT_TRUE(leases.CheckNotRefused("shared-2", "", t + absl::Seconds(3)).ok());
  // The tenant is let in again after the hour.
  EXPECT_TRUE(leases.CheckTenantNotRefused("mallory", t + absl::Minutes(62)).ok());
  EXPECT_TRUE(leases.TenantRefusals(t + absl::Minutes(62)).empty());
}

// A client's tenant is remembered after its lease is forgotten: a host may report its computation
// that never ended long after the client went (a tenant that schedules it and leaves).
TEST(ClientLeasesTest, AClientThatLeftBeforeItsRefusalStillTakesItsTenantWithIt) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60), absl::Hours(1));
  const absl::Time t = absl::UnixEpoch();
  ASSERT_TRUE(leases.CheckNotRefused("spinner", "mallory", t).ok());
  leases.Renew("spinner", t);
  leases.Goodbye("spinner", t + absl::Seconds(1));
  (void)leases.TakeDeparted(t + absl::Seconds(1));
  (void)leases.TakeDeparted(t + absl::Minutes(5));  // its lease is forgotten
  leases.Refuse("spinner", "its computation 'spin' held device 0 of h:1 for 600s", t + absl::Minutes(10));
  const absl::Status refused = leases.CheckNotRefused("newcomer", "mallory", t + absl::Minutes(11));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("refuses tenant mallory"), std::string::npos) << refused;
}

// A controller that restarted hears of a refusal from a host that registers again: the tenant is
// refused for what is left of it, never longer than this controller refuses for, with the reason
// bounded, and its clients known here depart.
TEST(ClientLeasesTest, ARefusalAHostNamesIsAdoptedForWhatIsLeftOfItAtMostTheRefusalTime) {
  ClientLeases leases(absl::Seconds(3), absl::Seconds(60), absl::Hours(1));
  const absl::Time t = absl::UnixEpoch();
  // A client of the tenant that called since the restart departs with the refusal.
  ASSERT_TRUE(leases.CheckNotRefused("known", "mallory", t).ok());
  leases.Renew("known", t);
  leases.AdoptRefusal({"mallory", "its client c was refused: 'spin' held device 0", t + absl::Minutes(20)}, t);
  EXPECT_EQ(leases.TakeDeparted(t), std::vector<std::string>{"known"});
  const absl::Status refused = leases.CheckNotRefused("newcomer", "mallory", t + absl::Minutes(19));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("'spin' held device 0"), std::string::npos) << refused;
  EXPECT_TRUE(leases.CheckNotRefused("newcomer", "mallory", t + absl::Minutes(21)).ok());
  EXPECT_TRUE(leases.CheckNotRefused("other", "alice", t + absl::Minutes(1)).ok());

  leases.AdoptRefusal({"eve", std::string(100000, 'x'), t + absl::Hours(100)}, t);
  const std::vector<TenantRefusal> in_force = leases.TenantRefusals(t + absl::Minutes(59));
  ASSERT_EQ(in_force.size(), 1u);
  EXPECT_EQ(in_force[0].tenant, "eve");
  EXPECT_EQ(in_force[0].until, t + absl::Hours(1));
  EXPECT_EQ(in_force[0].reason.size(), RefusedTenants::kMaxReasonBytes);
}

}  // namespace
}  // namespace pathways
