// A worker whose traffic is blackholed, with real processes in network namespaces that the test
// makes and removes itself: the controller, two workers and the tenants each get a namespace,
// joined by a bridge in a "switch" namespace. Cutting a worker's port on the bridge drops its
// packets silently (no reset, no error), as a partition does. Needs root (network namespaces);
// skipped with the reason otherwise.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "testing/network_namespaces.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

constexpr absl::Duration kStartTimeout = absl::Seconds(60);

// Runs a shell command to its end; its status and output.
std::pair<int, std::string> Sh(const std::string& command) { return RunShell(command, absl::Seconds(120)); }

// A tenant job from the tenants' namespace: its exit status and output.
std::pair<int, std::string> Tenant(Network& net, const std::string& controller, int devices) {
  std::vector<std::string> argv = net.In("t", {PATHWAYS_BINARY, "tenant", "--controller", controller, "--devices",
                                               std::to_string(devices), "--runs", "20"});
  return Sh(absl::StrJoin(argv, " "));
}

bool Passed(const std::pair<int, std::string>& r) {
  return WIFEXITED(r.first) && WEXITSTATUS(r.first) == 0 && r.second.find("CHECK PASSED") != std::string::npos;
}

TEST(PartitionTest, AWorkerCutOffFromTheNetworkFailsItsRunsAndLeavesWhenItIsBack) {
  if (std::string why = NetworkNamespacesUnavailable(); !why.empty()) GTEST_SKIP() << why;
  Network net({"c", "a", "b", "t"});
  ASSERT_TRUE(net.ok()) << net.error();

  Subprocess controller, victim, survivor, fresh;
  ASSERT_TRUE(controller
                  .Start(net.In("c", {PATHWAYS_BINARY, "controller", "--listen", net.Address("c") + ":0",
                                      "--heartbeat-timeout-ms", "1000", "--client-timeout-ms", "1000"}))
                  .ok());
  auto line = controller.WaitForLine("listening on", kStartTimeout);
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = line->substr(line->rfind(' ') + 1);
  auto start_worker = [&](Subprocess& p, const std::string& member) {
    ASSERT_TRUE(p.Start(net.In(member, {PATHWAYS_BINARY, "worker", "--controller", address, "--listen",
                                        net.Address(member) + ":0", "--devices", "2", "--collective-timeout-ms",
                                        "3000"}))
                    .ok());
    ASSERT_TRUE(p.WaitForLine("serving", kStartTimeout).ok());
  };
  ASSERT_NO_FATAL_FAILURE(start_worker(victim, "a"));
  ASSERT_NO_FATAL_FAILURE(start_worker(survivor, "b"));
  auto before = Tenant(net, address, 4);  // a gang over both workers
  ASSERT_TRUE(Passed(before)) << before.second;

  // Cut off mid-job: the job, whose gangs need the victim, fails naming it in bounded time; the
  // survivor serves the next job.
  Subprocess job;
  ASSERT_TRUE(job.Start({"/bin/sh", "-c",
                         absl::StrCat(absl::StrJoin(net.In("t", {PATHWAYS_BINARY, "tenant", "--controller", address,
                                                                 "--devices", "4", "--runs", "10000000"}),
                                                    " "),
                                      " 2>&1")})
                  .ok());
  ASSERT_TRUE(job.WaitForLine("runs over", kStartTimeout).ok());  // it is running
  ASSERT_TRUE(net.SetConnected("a", false).ok());
  auto failure = job.WaitForLine("pathways tenant:", absl::Seconds(60));
  ASSERT_TRUE(failure.ok()) << failure.status();
  EXPECT_NE(failure->find(net.Address("a")), std::string::npos) << *failure;
  std::printf("the cut-off job: %s\n", failure->c_str());
  auto job_exit = job.WaitFor(absl::Seconds(30));
  ASSERT_TRUE(job_exit.ok()) << job_exit.status();
  EXPECT_FALSE(WIFEXITED(*job_exit) && WEXITSTATUS(*job_exit) == 0);
  auto alone = Tenant(net, address, 2);
  EXPECT_TRUE(Passed(alone)) << alone.second;
  EXPECT_FALSE(victim.WaitFor(absl::ZeroDuration()).ok());  // it runs on, unreachable

  // Reconnected, it hears that it was declared dead and leaves; a new worker takes its place.
  ASSERT_TRUE(net.SetConnected("a", true).ok());
  auto exited = victim.WaitFor(absl::Seconds(60));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) != 0) << *exited;
  ASSERT_NO_FATAL_FAILURE(start_worker(fresh, "a"));
  auto after = Tenant(net, address, 4);
  EXPECT_TRUE(Passed(after)) << after.second;

  for (Subprocess* p : {&fresh, &survivor, &controller}) EXPECT_EQ(p->Stop(SIGTERM) & 0x7f, 0);
}

}  // namespace
}  // namespace pathways
