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
  // What a function of a two-letter name is charged here: what it keeps, and its entry.
  static int64_t Charge() {
    return kEach + FunctionCache::kEntryBytes + static_cast<int64_t>(FunctionKey(Body("f1")).size()) + 2;
  }
  static bool Has(const std::vector<std::string>& clients, const std::string& client) {
    return std::find(clients.begin(), clients.end(), client) != clients.end();
  }
  int compiles_ = 0;
};

TEST_F(FunctionCacheTest, AFunctionStaysUntilTheLastClientItWasCompiledForIsReleased) {
  FunctionCache cache = MakeCache(8 * Charge(), 8 * Charge());
  const std::string key = FunctionKey(Body("f1"));
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f1"), {"b"}).ok());
  EXPECT_EQ(compiles_, 1);  // compiled once, kept for both
  EXPECT_EQ(cache.held_bytes(), Charge());
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
  EXPECT_EQ(running->name(), "f1");
  EXPECT_EQ(cache.Release("b"), 0);  // idempotent
  EXPECT_EQ(cache.Release("never"), 0);
  // Compiled again for a new client.
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c"}).ok());
  EXPECT_EQ(compiles_, 2);
}

TEST_F(FunctionCacheTest, TheHostsOwnFunctionsStayForTheCachesLife) {
  FunctionCache cache = MakeCache(8 * Charge(), 8 * Charge());
  ASSERT_TRUE(cache.Compile(Body("f1")).ok());
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  EXPECT_EQ(cache.account_bytes({"a"}), Charge());
  EXPECT_EQ(cache.Release("a"), 0);
  EXPECT_NE(cache.Lookup(FunctionKey(Body("f1"))), nullptr);
  EXPECT_EQ(cache.account_bytes({"a"}), 0);
  EXPECT_EQ(cache.held_bytes(), Charge());
  EXPECT_TRUE(cache.Clients().empty());
}

TEST_F(FunctionCacheTest, AClientKeepsAtMostItsAllowanceAndOthersStillCompile) {
  FunctionCache cache = MakeCache(8 * Charge(), 2 * Charge() + kEach / 2);
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"a"}).ok());
  auto refused = cache.Compile(Body("f3"), {"a"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string part :
       {"'f3' keeps", "this client keeps", "--compiled-memory-per-client", "go when the client does"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << part << " in: " << refused.status();
  }
  // The refusal kept nothing: another client compiles the same body, and the first's share is
  // unchanged.
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.account_bytes({"a"}), 2 * Charge());
  ASSERT_TRUE(cache.Compile(Body("f3"), {"b"}).ok());
  // Already compiled, it still counts against a client that asks for it.
  EXPECT_EQ(cache.Compile(Body("f3"), {"a"}).status().code(), absl::StatusCode::kResourceExhausted);
  // Once the client lets go of one, it may keep another.
  EXPECT_EQ(cache.Release("a"), 2);
  ASSERT_TRUE(cache.Compile(Body("f3"), {"a"}).ok());
  EXPECT_EQ(cache.account_bytes({"a"}), Charge());
  EXPECT_EQ(cache.account_bytes({"b"}), Charge());
}

TEST_F(FunctionCacheTest, ANamedTenantsClientsShareOneAllowanceAndAFunctionCountsOnceInIt) {
  FunctionCache cache = MakeCache(8 * Charge(), 2 * Charge() + kEach / 2);
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c1", "t"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"c2", "t"}).ok());
  auto refused = cache.Compile(Body("f3"), {"c3", "t"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string part : {"tenant t's clients keep", "each named tenant", "go when its clients do"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << part << " in: " << refused.status();
  }
  EXPECT_FALSE(Has(cache.Clients(), "c3"));  // a refused client holds nothing here
  // A function another client of the tenant has is not charged twice.
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c2", "t"}).ok());
  EXPECT_EQ(cache.account_bytes({"", "t"}), 2 * Charge());
  // Nor is it uncharged while one of them keeps it.
  EXPECT_EQ(cache.Release("c1"), 0);
  EXPECT_EQ(cache.account_bytes({"", "t"}), 2 * Charge());
  EXPECT_EQ(cache.Release("c2"), 2);
  EXPECT_EQ(cache.account_bytes({"", "t"}), 0);
  // Another tenant was never limited by t's, nor is a client whose id is t's name.
  ASSERT_TRUE(cache.Compile(Body("f3"), {"d1", "u"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f1"), {"c1", "t"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"c2", "t"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f4"), {"t"}).ok());
  EXPECT_EQ(cache.account_bytes({"t"}), Charge());
}

TEST_F(FunctionCacheTest, WhatAllKeepIsBoundedAndFreedWhenTheirClientsGo) {
  FunctionCache cache = MakeCache(3 * Charge(), 2 * Charge());
  ASSERT_TRUE(cache.Compile(Body("f1"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f2"), {"a"}).ok());
  ASSERT_TRUE(cache.Compile(Body("f3"), {"b"}).ok());
  auto refused = cache.Compile(Body("f4"), {"c"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string part : {"'f4'", "3 functions compiled on this worker", "--compiled-memory;"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << part << " in: " << refused.status();
  }
  EXPECT_EQ(compiles_, 3);  // the cache had no room for even its entry: never compiled
  EXPECT_FALSE(Has(cache.Clients(), "c"));
  EXPECT_EQ(cache.account_bytes({"c"}), 0);
  // The client that filled most of it goes: the others compile again.
  EXPECT_EQ(cache.Release("a"), 2);
  EXPECT_EQ(cache.held_bytes(), Charge());
  ASSERT_TRUE(cache.Compile(Body("f4"), {"c"}).ok());
  EXPECT_EQ(cache.held_bytes(), 2 * Charge());
}

// A function that keeps nothing once compiled (a built-in kernel) is charged its entry all the
// same; and a client with no room left is refused before the compiler runs.
TEST_F(FunctionCacheTest, FunctionsThatKeepNothingAreChargedTheirEntryAndAFullAccountIsNotCompiledFor) {
  FunctionCache cache(
      [this](const FunctionBody& body) -> absl::StatusOr<std::shared_ptr<const Executable>> {
        ++compiles_;
        return std::make_shared<Kept>(body.name, 0);
      },
      64 * FunctionCache::kEntryBytes, 3 * FunctionCache::kEntryBytes + FunctionCache::kEntryBytes / 2);
  int kept = 0;
  absl::Status refused;
  for (int i = 0; i < 100 && refused.ok(); ++i) {
    refused = cache.Compile(Body("k" + std::to_string(i)), {"a"}).status();
    kept += refused.ok();
  }
  EXPECT_EQ(kept, 3);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("keeps at least"), std::string::npos) << refused;
  EXPECT_EQ(compiles_, 3);  // the refused one was never compiled
  EXPECT_GE(cache.account_bytes({"a"}), 3 * FunctionCache::kEntryBytes);
}

TEST(FunctionCacheBodies, ABuiltinKernelGivenASourceIsRefused) {
  FunctionCache cache;
  auto refused = cache.Compile({FunctionBody::Kind::kBuiltin, "add_one", "anything"}, {"a"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("takes no source"), std::string::npos) << refused.status();
  EXPECT_TRUE(cache.Compile({FunctionBody::Kind::kBuiltin, "add_one", ""}, {"a"}).ok());
}

TEST_F(FunctionCacheTest, ACompilerErrorKeepsNothing) {
  FunctionCache cache([](const FunctionBody& body) -> absl::StatusOr<std::shared_ptr<const Executable>> {
    return absl::InvalidArgumentError("no: " + body.name);
  });
  EXPECT_EQ(cache.Compile(Body("f1"), {"a"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_TRUE(cache.Clients().empty());
}

}  // namespace
}  // namespace pathways
