#include "transport/tenant_tokens.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/pathways.pb.h"

namespace pathways {
namespace {

constexpr char kCluster[] = "cluster-0123456789abcdef";

TEST(TenantTokensTest, EachTokenNamesItsTenant) {
  auto tenants = TenantTokens::Parse("shared-token", R"(
# name   token
alice  alice-0123456789abcdef
bob	bob-0123456789abcdef   # a comment after
)",
                                     "tenants.txt", kCluster);
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  EXPECT_FALSE(tenants->open());
  EXPECT_EQ(tenants->named(), 2u);
  EXPECT_EQ(*tenants->TenantOf("alice-0123456789abcdef"), "alice");
  EXPECT_EQ(*tenants->TenantOf("bob-0123456789abcdef"), "bob");
  EXPECT_EQ(*tenants->TenantOf("shared-token"), "");
  EXPECT_EQ(tenants->TenantOf("alice-0123456789abcdeX").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tenants->TenantOf("").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tenants->TenantOf(kCluster).status().code(), absl::StatusCode::kUnauthenticated);
}

TEST(TenantTokensTest, WithoutTokensEveryCallIsTheUnnamedTenant) {
  TenantTokens open;
  EXPECT_TRUE(open.open());
  EXPECT_EQ(*open.TenantOf(""), "");
  EXPECT_EQ(*open.TenantOf("anything"), "");
  TenantTokens one("s3cret");
  EXPECT_FALSE(one.open());
  EXPECT_EQ(*one.TenantOf("s3cret"), "");
  EXPECT_FALSE(one.TenantOf("guess").ok());
  // Named tenants alone, no shared token: only they are let in.
  auto named = TenantTokens::Parse("", "alice alice-0123456789abcdef\n", "t", kCluster);
  ASSERT_TRUE(named.ok());
  EXPECT_FALSE(named->open());
  EXPECT_FALSE(named->TenantOf("").ok());
}

TEST(TenantTokensTest, ABadFileIsRefusedNamingTheLineNeverItsToken) {
  struct Case {
    std::string text;
    const char* says;
    std::string secret;  // must not be printed
  };
  for (const Case& c : std::vector<Case>{
           {"alice\n", "t:1: a tenant is a line 'NAME TOKEN', this one has 1 fields", "alice"},
           {"\nalice a b\n", "t:2: a tenant is a line", "alice a b"},
           {"al/ice alice-0123456789abcdef\n", "t:1: the name (first field) is not 1-64", "alice-0123456789abcdef"},
           {"alice short\n", "t:1: the token (second field) has 5 characters; at least 16", "short"},
           // The fields the wrong way round: the "name" is the token.
           {"0123456789abcdef0123 alice\n", "t:1: the token (second field) has 5", "0123456789abcdef0123"},
           {"alice alice-0123456789abcdef\nalice other-0123456789abcdef\n", "t:2: the name was given on line 1",
            "0123456789abcdef"},
           {"alice same-0123456789abcdef\nbob same-0123456789abcdef\n", "t:2: the token is line 1's too",
            "same-0123456789abcdef"},
           {"alice shared-0123456789abcdef\n", "t:1: the token is the shared --token", "shared-0123456789abcdef"},
           {"alice cluster-0123456789abcdef\n", "t:1: the token is the cluster token", "cluster-0123456789abcdef"},
           {"alice alice-0123456789abcde\x01\n", "t:1 (second field)", "alice-0123456789abcde"},
       }) {
    auto tenants = TenantTokens::Parse("shared-0123456789abcdef", c.text, "t", kCluster);
    ASSERT_FALSE(tenants.ok()) << c.text;
    EXPECT_EQ(tenants.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(tenants.status().message().find(c.says), std::string::npos) << tenants.status();
    EXPECT_EQ(tenants.status().message().find(c.secret), std::string::npos) << tenants.status();
  }
}

// '#' starts a comment only at the start of a field: a token may hold one, whole.
TEST(TenantTokensTest, AHashInsideATokenIsPartOfIt) {
  auto tenants = TenantTokens::Parse("", "alice 0123456789abcdef#tail  # alice's\n#bob x\n", "t", kCluster);
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  EXPECT_EQ(tenants->named(), 1u);
  EXPECT_EQ(*tenants->TenantOf("0123456789abcdef#tail"), "alice");
  EXPECT_FALSE(tenants->TenantOf("0123456789abcdef").ok());
}

TEST(TenantTokensTest, LoadsAFileAndRefusesOneItCannotReadOrWithoutAClusterToken) {
  const std::string path = ::testing::TempDir() + "/pathways_tenants_test";
  {
    std::ofstream file(path);
    file << "alice alice-0123456789abcdef\n";
  }
  auto loaded = TenantTokens::Load("", path, kCluster);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded->TenantOf("alice-0123456789abcdef"), "alice");
  EXPECT_EQ(TenantTokens::Load("", path + ".missing", kCluster).status().code(), absl::StatusCode::kNotFound);
  auto unguarded = TenantTokens::Load("", path, "");
  EXPECT_EQ(unguarded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unguarded.status().message().find("needs a cluster token of its own"), std::string::npos);
  // The shared token as the cluster token: its holders could act as hosts.
  EXPECT_EQ(TenantTokens::Load("shared-0123456789abcdef", path, "shared-0123456789abcdef").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TenantTokens::Load("t", "", "").ok());  // no file: the shared token alone
}

// A worker's copy of the controller's refusals: each ends at its own time, says why, and travels
// as time left (hosts' clocks need not agree).
TEST(RefusedTenantsTest, ARefusalEndsAtItsTimeSaysWhyAndTravelsAsTimeLeft) {
  const absl::Time t = absl::FromUnixSeconds(1'000'000);
  RefusedTenants refused;
  refused.Add({"mallory", "its client c was refused: 'spin' held device 0", t + absl::Hours(1)}, t);
  refused.Add({"", "the shared token's clients are no tenant", t + absl::Hours(1)}, t);
  EXPECT_TRUE(refused.InForce(t).size() == 1) << "the unnamed tenant is never refused";
  EXPECT_TRUE(refused.Check("alice", t).ok());
  EXPECT_TRUE(refused.Check("", t).ok());
  const absl::Status no = refused.Check("mallory", t + absl::Minutes(59));
  EXPECT_EQ(no.code(), absl::StatusCode::kFailedPrecondition) << no;
  EXPECT_NE(no.message().find("refuses tenant mallory until "), std::string::npos) << no;
  EXPECT_NE(no.message().find("'spin' held device 0"), std::string::npos) << no;
  EXPECT_TRUE(refused.Check("mallory", t + absl::Minutes(61)).ok());
  // A shorter refusal of the same tenant does not shorten it; a longer one lengthens it.
  refused.Add({"mallory", "again", t + absl::Minutes(5)}, t);
  EXPECT_FALSE(refused.Check("mallory", t + absl::Minutes(59)).ok());
  refused.Add({"mallory", "again, longer", t + absl::Hours(2)}, t);
  ASSERT_EQ(refused.InForce(t + absl::Minutes(90)).size(), 1u);
  EXPECT_EQ(refused.InForce(t + absl::Minutes(90))[0].reason, "again, longer");
  EXPECT_TRUE(refused.InForce(t + absl::Hours(3)).empty());

  // Sent at t with 40 minutes left; received by a host whose clock reads another time.
  const TenantRefusal sent{"mallory", "why", t + absl::Minutes(40)};
  const TenantRefusal got = FromProto(ToProto(sent, t), absl::UnixEpoch());
  EXPECT_EQ(got.tenant, "mallory");
  EXPECT_EQ(got.reason, "why");
  EXPECT_EQ(got.until, absl::UnixEpoch() + absl::Minutes(40));
  EXPECT_EQ(FromProto(ToProto(sent, t + absl::Hours(1)), t).until, t);  // ended: nothing left

  // Set replaces every refusal.
  refused.Set({{"eve", "why", t + absl::Hours(1)}, {"no such name!", "why", t + absl::Hours(1)}}, t);
  EXPECT_TRUE(refused.Check("mallory", t + absl::Minutes(90)).ok());
  EXPECT_FALSE(refused.Check("eve", t).ok());
  // Names no tenant can have are left out, and reasons are cut: a heartbeat answer carries them all.
  EXPECT_EQ(refused.InForce(t).size(), 1u);
  refused.Add({"eve", std::string(100000, 'x'), t + absl::Hours(2)}, t);
  EXPECT_EQ(refused.InForce(t)[0].reason.size(), RefusedTenants::kMaxReasonBytes);
}

// Bounded: past kMax refusals, those that end soonest make room.
TEST(RefusedTenantsTest, KeepsAtMostKMaxRefusalsDroppingThoseThatEndSoonest) {
  const absl::Time t = absl::FromUnixSeconds(1'000'000);
  RefusedTenants refused;
  for (size_t i = 0; i <= RefusedTenants::kMax; ++i) {
    refused.Add({absl::StrCat("tenant", i), "why", t + absl::Minutes(10) + absl::Seconds(static_cast<int64_t>(i))}, t);
  }
  EXPECT_EQ(refused.InForce(t).size(), RefusedTenants::kMax);
  EXPECT_TRUE(refused.Check("tenant0", t).ok());  // it ended soonest
  EXPECT_FALSE(refused.Check(absl::StrCat("tenant", RefusedTenants::kMax), t).ok());
}

}  // namespace
}  // namespace pathways
