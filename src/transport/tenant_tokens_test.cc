#include "transport/tenant_tokens.h"

#include <fstream>

#include "gtest/gtest.h"

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

TEST(TenantTokensTest, ABadFileIsRefusedNamingTheLine) {
  struct Case {
    const char* text;
    const char* says;
  };
  for (const Case& c : std::vector<Case>{
           {"alice\n", "t:1: a tenant is a line 'NAME TOKEN', this one has 1 fields"},
           {"\nalice a b\n", "t:2: a tenant is a line"},
           {"al/ice alice-0123456789abcdef\n", "t:1: tenant name 'al/ice'"},
           {"alice short\n", "t:1: tenant alice's token has 5 characters; at least 16"},
           {"alice alice-0123456789abcdef\nalice other-0123456789abcdef\n", "t:2: tenant alice is named twice"},
           {"alice same-0123456789abcdef\nbob same-0123456789abcdef\n", "t:2: tenant bob's token is another"},
           {"alice shared-0123456789abcdef\n", "t:1: tenant alice's token is another tenant's (or the shared"},
           {"alice cluster-0123456789abcdef\n", "the cluster token, which would let it pose as a host"},
           {"alice alice-0123456789abcde\x01\n", "t:1 (tenant alice)"},
       }) {
    auto tenants = TenantTokens::Parse("shared-0123456789abcdef", c.text, "t", kCluster);
    ASSERT_FALSE(tenants.ok()) << c.text;
    EXPECT_EQ(tenants.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(tenants.status().message().find(c.says), std::string::npos) << tenants.status();
    // Never the tokens themselves.
    EXPECT_EQ(tenants.status().message().find("0123456789abcdef"), std::string::npos) << tenants.status();
  }
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
  EXPECT_NE(unguarded.status().message().find("needs a cluster token"), std::string::npos);
  EXPECT_TRUE(TenantTokens::Load("t", "", "").ok());  // no file: the shared token alone
}

}  // namespace
}  // namespace pathways
