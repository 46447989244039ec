// Gangs over several islands, from several tenants, as real processes.
#include <signal.h>
#include <sys/wait.h>

#include "gtest/gtest.h"
#include "multiprocess_fixture.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

// Two islands of one 4-device worker each, and two tenants whose gangs (an all_reduce over all
// eight devices) span both islands, `runs` runs each. Returns whether each tenant checked every
// result, and its output's last line.
std::vector<std::pair<bool, std::string>> TenantsOverTwoIslands(const std::vector<std::string>& controller_flags,
                                                                 int runs) {
  Subprocess controller;
  std::vector<std::string> controller_args = {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"};
  controller_args.insert(controller_args.end(), controller_flags.begin(), controller_flags.end());
  EXPECT_TRUE(controller.Start(controller_args).ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  EXPECT_TRUE(line.ok()) << line.status();
  if (!line.ok()) return {};
  const std::string address = line->substr(line->rfind(' ') + 1);
  Subprocess workers[2];
  for (int island = 0; island < 2; ++island) {
    EXPECT_TRUE(workers[island]
                    .Start({PATHWAYS_BINARY, "worker", "--controller", address, "--island", std::to_string(island),
                            "--devices", "4", "--device-memory", "64MiB", "--collective-timeout-ms", "3000"})
                    .ok());
    EXPECT_TRUE(workers[island].WaitForLine("serving", kStartTimeout).ok());
  }
  Subprocess tenants[2];
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(tenants[i]
                    .Start({PATHWAYS_BINARY, "tenant", "--controller", address, "--devices", "8", "--span-islands",
                            "--runs", std::to_string(runs), "--value", std::to_string(i + 1), "--wait-for-go"})
                    .ok());
  }
  // Both start their runs once both are set up, so that their gangs overlap even on a loaded
  // machine (a tenant started late could otherwise find the other one done).
  for (auto& tenant : tenants) EXPECT_TRUE(tenant.WaitForLine(" runs over ", kStartTimeout).ok());
  for (auto& tenant : tenants) EXPECT_TRUE(tenant.WriteLine("go").ok());
  std::vector<std::pair<bool, std::string>> results;
  // Seconds on this machine; a tenant still running at the deadline hangs, and the test says
  // where every process of the cluster is before it ends them.
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  for (int i = 0; i < 2; ++i) {
    Subprocess& tenant = tenants[i];
    std::string last;
    bool passed = false;
    // A tenant prints its verdict and exits; one whose run failed exits with an error.
    for (int n = 0; n < 1000; ++n) {
      auto out = tenant.ReadLine(std::max(deadline - absl::Now(), absl::Milliseconds(1)));
      if (!out.ok()) break;
      last = *out;
      if (last.find("CHECK PASSED") != std::string::npos) passed = true;
    }
    absl::StatusOr<int> status = tenant.WaitFor(std::max(deadline - absl::Now(), absl::Milliseconds(1)));
    if (!status.ok()) {
      ADD_FAILURE() << "tenant " << i << " still runs after 120 s (its last line: '" << last << "'). Its threads:\n"
                    << tenant.StackTraces() << "\nthe controller's:\n" << controller.StackTraces()
                    << "\nisland 0's worker's:\n" << workers[0].StackTraces() << "\nisland 1's worker's:\n"
                    << workers[1].StackTraces();
      tenant.Stop(SIGKILL);
      results.push_back({false, last});
      continue;
    }
    results.push_back({passed && WIFEXITED(*status) && WEXITSTATUS(*status) == 0, last});
  }
  for (auto& w : workers) w.Stop(SIGTERM);
  controller.Stop(SIGTERM);
  return results;
}

// The paper's multi-island gangs: runs over two islands are ordered the same way on both, so two
// tenants whose gangs span both islands never meet out of order.
TEST(CrossIslandTest, GangsOverTwoIslandsFromTwoTenantsAllComplete) {
  for (const auto& [passed, last] : TenantsOverTwoIslands({}, 300)) EXPECT_TRUE(passed) << last;
}

TEST(CrossIslandTest, GangsOverTwoIslandsFromTwoTenantsAllCompleteUnderProportionalShare) {
  for (const auto& [passed, last] : TenantsOverTwoIslands({"--scheduler", "share"}, 300)) EXPECT_TRUE(passed) << last;
}

// The same with each island's scheduler reached independently, the two tenants in opposite
// island orders: gangs meet out of order and fail, which is what the ordering prevents.
TEST(CrossIslandTest, WithoutTheCrossIslandOrderTheSameTenantsFail) {
  int failed = 0;
  for (const auto& [passed, last] : TenantsOverTwoIslands({"--test-unordered-islands"}, 300)) failed += passed ? 0 : 1;
  EXPECT_GT(failed, 0);
}

// Without an island or span_islands, a slice larger than any island is refused, naming why.
TEST(CrossIslandTest, ASliceLargerThanAnyIslandIsRefusedUnlessItMaySpanIslands) {
  Subprocess controller;
  ASSERT_TRUE(controller.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"}).ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = line->substr(line->rfind(' ') + 1);
  Subprocess workers[2];
  for (int island = 0; island < 2; ++island) {
    ASSERT_TRUE(workers[island]
                    .Start({PATHWAYS_BINARY, "worker", "--controller", address, "--island", std::to_string(island),
                            "--devices", "2", "--device-memory", "16MiB"})
                    .ok());
    ASSERT_TRUE(workers[island].WaitForLine("serving", kStartTimeout).ok());
  }
  auto client = Client::Connect(address);
  ASSERT_TRUE(client.ok()) << client.status();
  auto too_big = (*client)->CreateSlice({.mesh_shape = {4}});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_NE(too_big.status().message().find("span"), std::string::npos) << too_big.status();
  auto within = (*client)->CreateSlice({.mesh_shape = {2}});
  ASSERT_TRUE(within.ok()) << within.status();
  EXPECT_EQ(within->host_addresses().size(), 1u);
  auto spanning = (*client)->CreateSlice({.mesh_shape = {4}, .span_islands = true});
  ASSERT_TRUE(spanning.ok()) << spanning.status();
  EXPECT_EQ(spanning->host_addresses().size(), 2u);
  client->reset();
  for (auto& w : workers) w.Stop(SIGTERM);
  controller.Stop(SIGTERM);
}

}  // namespace
}  // namespace pathways
