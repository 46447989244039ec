#include "compute/function_cache.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

// An executable that keeps `held` bytes (as a function's graph and folded constants would).
class Kept : public Executable {
 public:
  Kept(std::string name, int64_t held) : name_(std::move(name)), held_(held) {}
  const std::string& name() const override { return name_; }
  absl::Status Run(absl::Span<const DeviceBuffer* const>, absl::Span<DeviceBuffer* const>) const override {
    return absl::OkStatus();
  }
  int64_t held_bytes() const override { return held_; }

 private:
  const std::string name_;
  const int64_t held_;
};

constexpr int64_t kEach = 1 << 20;

// Each body keeps kEach bytes once compiled; the cache counts the compiles it asked for.
class FunctionCacheTest : public ::testing::Test {
 protected:
  FunctionCache MakeCache(int64_t limit, int64_t account_limit) {
    return FunctionCache(
        [this](const FunctionBody& body) -> absl::StatusOr<std::shared_ptr<const Executable>> {
          ++compiles_;
          return std::make_shared<Kept>(body.name, kEach);
        },
        limit, account_limit);
  }
  static FunctionBody Body(const std::string& name) {
    return {FunctionBody::Kind::kTorchScript, name, "def " + name + "(x):\n    return x\n"};
  }
  static bool Has(const std::vector<std::string>& clients, const std::string& client) {
    return std::find(clients.begin(), clients.end(), client) != clients.end();
  }
  int compiles_ = 0;
};

TEST_F(FunctionCacheTest, AFunctionStaysUntilTheLastClientItWasCompiledForIsReleased) {
  FunctionCache cache = MakeCache(8 * kEach, 8 * kEach);
  const std::string key = FunctionKey(Body("f"));
  ASSERT_TRUE(cache.Compile(Body("f"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f"), {"b"}).ok());
  EXPECT_EQ(compiles_, 1);  // compiled once, kept for both
  EXPECT_TRUE(Has(cache.Clients(), "a") && Has(cache.Clients(), "b"));
  EXPECT_EQ(cache.Release("a"), 0);
  EXPECT_NE(cache.Lookup(key), nullptr);
  EXPECT_FALSE(Has(cache.Clients(), "a"));
  // An executable a run holds outlives its release.
  std::shared_ptr<const Executable> running = cache.Lookup(key);
  EXPECT_EQ(cache.Release("b"), 1);
  EXPECT_EQ(cache.Lookup(key), nullptr);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_EQ(cache.held_bytes(), 0);
  EXPECT_TRUE(cache.Clients().empty());
  EXPECT_EQ(running->name(), "f");
  EXPECT_EQ(cache.Release("b"), 0);  // idempotent
  EXPECT_EQ(cache.Release("never"), 0);
  // Compiled again for a new client.
  ASSERT_TRUE(cache.Compile(Body("f"), {"c"}).ok());
  EXPECT_EQ(compiles_, 2);
}

TEST_F(FunctionCacheTest, TheHostsOwnFunctionsStayForTheCachesLife) {
  FunctionCache cache = MakeCache(8 * kEach, 8 * kEach);
  ASSERT_TRUE(cache.Compile(Body("f")).ok());
  ASSERT_TRUE(cache.Compile(Body("f"), {"a"}).ok());
  EXPECT_EQ(cache.account_bytes("a"), kEach);
  EXPECT_EQ(cache.Release("a"), 0);
  EXPECT_NE(cache.Lookup(FunctionKey(Body("f"))), nullptr);
  EXPECT_EQ(cache.account_bytes("a"), 0);
  EXPECT_EQ(cache.held_bytes(), kEach);
  EXPECT_TRUE(cache.Clients().empty());
}

TEST_F(FunctionCacheTest, AClientKeepsAtMostItsAllowanceAndOthersStillCompile) {
  FunctionCache cache = MakeCache(8 * kEach, 2 * kEach + kEach / 2);
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"a"}).ok());
  auto refused = cache.Compile(Body("f3"), {"a"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string part :
       {"'f3'", "this client keeps", "--compiled-memory-per-client", "go when the client does"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << part << " in: " << refused.status();
  }
  // The refusal kept nothing: another client compiles the same body, and the first's share is
  // unchanged.
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.account_bytes("a"), 2 * kEach);
  ASSERT_TRUE(cache.Compile(Body("f3"), {"b"}).ok());
  // Already compiled, it still counts against a client that asks for it.
  EXPECT_EQ(cache.Compile(Body("f3"), {"a"}).status().code(), absl::StatusCode::kResourceExhausted);
  // Once the client lets go of one, it may keep another.
  EXPECT_EQ(cache.Release("a"), 2);
  ASSERT_TRUE(cache.Compile(Body("f3"), {"a"}).ok());
  EXPECT_EQ(cache.account_bytes("a"), kEach);
  EXPECT_EQ(cache.account_bytes("b"), kEach);
}

TEST_F(FunctionCacheTest, ANamedTenantsClientsShareOneAllowanceAndAFunctionCountsOnceInIt) {
  FunctionCache cache = MakeCache(8 * kEach, 2 * kEach + kEach / 2);
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c1", "t"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"c2", "t"}).ok());
  auto refused = cache.Compile(Body("f3"), {"c3", "t"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("tenant 't''s clients keep"), std::string::npos) << refused.status();
  EXPECT_FALSE(Has(cache.Clients(), "c3"));  // a refused client holds nothing here
  // A function another client of the tenant has is not charged twice.
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c2", "t"}).ok());
  EXPECT_EQ(cache.account_bytes("t"), 2 * kEach);
  // Nor is it uncharged while one of them keeps it.
  EXPECT_EQ(cache.Release("c1"), 0);
  EXPECT_EQ(cache.account_bytes("t"), 2 * kEach);
  EXPECT_EQ(cache.Release("c2"), 2);
  EXPECT_EQ(cache.account_bytes("t"), 0);
  // Another tenant was never limited by t's.
  ASSERT_TRUE(cache.Compile(Body("f3"), {"d1", "u"}).ok());
}

TEST_F(FunctionCacheTest, WhatAllKeepIsBoundedAndFreedWhenTheirClientsGo) {
  FunctionCache cache = MakeCache(3 * kEach, 2 * kEach);
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f3"), {"b"}).ok());
  auto refused = cache.Compile(Body("f4"), {"c"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string part : {"'f4'", "3 functions compiled on this worker", "--compiled-memory;"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << part << " in: " << refused.status();
  }
  EXPECT_FALSE(Has(cache.Clients(), "c"));
  EXPECT_EQ(cache.account_bytes("c"), 0);
  // The client that filled most of it goes: the others compile again.
  EXPECT_EQ(cache.Release("a"), 2);
  EXPECT_EQ(cache.held_bytes(), kEach);
  ASSERT_TRUE(cache.Compile(Body("f4"), {"c"}).ok());
  EXPECT_EQ(cache.held_bytes(), 2 * kEach);
}

TEST_F(FunctionCacheTest, ACompilerErrorKeepsNothing) {
  FunctionCache cache([](const FunctionBody& body) -> absl::StatusOr<std::shared_ptr<const Executable>> {
    return absl::InvalidArgumentError("no: " + body.name);
  });
  EXPECT_EQ(cache.Compile(Body("f"), {"a"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_TRUE(cache.Clients().empty());
}

}  // namespace
}  // namespace pathways
