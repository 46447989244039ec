// Workers whose traffic is blackholed, with real processes in network namespaces that the test
// makes and removes itself: the controller, two workers and the tenants each get a namespace,
// joined by a bridge in a "switch" namespace. Cutting a worker's port on the bridge drops its
// packets silently (no reset, no error), as a partition does. Needs root (network namespaces);
// skipped with the reason otherwise.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
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

// The controller in "c", the workers in "a" and "b", the tenants in "t".
class PartitionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = NetworkNamespacesUnavailable(); !why.empty()) GTEST_SKIP() << why;
    net_ = std::make_unique<Network>(std::vector<std::string>{"c", "a", "b", "t"});
    ASSERT_TRUE(net_->ok()) << net_->error();
    ASSERT_TRUE(controller_
                    .Start(net_->In("c", {PATHWAYS_BINARY, "controller", "--listen", net_->Address("c") + ":0",
                                          "--heartbeat-timeout-ms", "1000", "--client-timeout-ms", "1000"}))
                    .ok());
    auto line = controller_.WaitForLine("listening on", kStartTimeout);
    ASSERT_TRUE(line.ok()) << line.status();
    address_ = line->substr(line->rfind(' ') + 1);
  }
  // A worker of two devices in `member`'s namespace, with `flags` too; with `log`, its log goes to
  // LogOf(member) (replaced), where the test reads it.
  void StartWorker(Subprocess& p, const std::string& member, std::vector<std::string> flags = {}, bool log = false) {
    std::vector<std::string> argv = {PATHWAYS_BINARY, "worker", "--controller", address_, "--listen",
                                     net_->Address(member) + ":0", "--devices", "2", "--collective-timeout-ms", "3000"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv = net_->In(member, argv);
    if (log) argv = {"/bin/sh", "-c", absl::StrCat("exec ", absl::StrJoin(argv, " "), " 2> ", LogOf(member))};
    ASSERT_TRUE(p.Start(argv).ok());
    ASSERT_TRUE(p.WaitForLine("serving", kStartTimeout).ok());
  }
  std::string LogOf(const std::string& member) const {
    return absl::StrCat(::testing::TempDir(), "partition_test.", getpid(), ".", member, ".log");
  }
  // The line of `member`'s log that says `needle`; empty when none does yet.
  std::string LogLine(const std::string& member, const std::string& needle) const {
    std::ifstream in(LogOf(member));
    for (std::string line; std::getline(in, line);) {
      if (line.find(needle) != std::string::npos) return line;
    }
    return "";
  }
  void TearDown() override {
    for (const char* member : {"a", "b"}) std::remove(LogOf(member).c_str());
  }

  std::unique_ptr<Network> net_;
  Subprocess controller_;
  std::string address_;
};

TEST_F(PartitionTest, AWorkerCutOffFromTheNetworkFailsItsRunsAndLeavesWhenItIsBack) {
  Network& net = *net_;
  Subprocess& controller = controller_;
  const std::string& address = address_;
  Subprocess victim, survivor, fresh;
  auto start_worker = [&](Subprocess& p, const std::string& member) { StartWorker(p, member); };
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

// Two workers that can no longer reach each other, while both still reach the controller (a
// partition between them alone), during a pipeline whose stages are on one each: the dataflow
// batches between them go nowhere, one of them names the other to the controller, and one of the
// two is made to leave, saying why. The other serves the next job; once the network is whole
// again, a new worker in the place of the one that left makes the island whole.
TEST_F(PartitionTest, TwoWorkersThatCannotReachEachOtherEndWithOneOfThemLeaving) {
  Network& net = *net_;
  Subprocess& controller = controller_;
  const std::string& address = address_;
  Subprocess a, b, fresh;
  // The test reads why one left in their logs.
  auto start_worker = [&](Subprocess& p, const std::string& member) {
    StartWorker(p, member, {"--peer-stall-timeout-ms", "2000"}, /*log=*/true);
  };
  ASSERT_NO_FATAL_FAILURE(start_worker(a, "a"));
  ASSERT_NO_FATAL_FAILURE(start_worker(b, "b"));

  // A pipeline of two stages of two devices: one stage on each worker.
  Subprocess job;
  ASSERT_TRUE(job.Start({"/bin/sh", "-c",
                         absl::StrCat(absl::StrJoin(net.In("t", {PATHWAYS_BINARY, "train", "--controller", address,
                                                                 "--pipeline-stages", "2", "--tensor-parallel", "2",
                                                                 "--steps", "400"}),
                                                    " "),
                                      " 2>&1")})
                  .ok());
  ASSERT_TRUE(job.WaitForLine("step ", kStartTimeout).ok());  // it is running (a line every 20 steps)
  ASSERT_TRUE(net.SetReachable("a", "b", false).ok());
  ASSERT_TRUE(net.SetReachable("b", "a", false).ok());

  // One of the two is made to leave, in bounded time, and says why.
  std::map<std::string, Subprocess*> workers = {{"a", &a}, {"b", &b}};
  std::string left, why;
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (left.empty() && absl::Now() < deadline) {
    for (auto& [member, p] : workers) {
      if (std::string l = LogLine(member, "made to leave"); !l.empty()) {
        left = member;
        why = l;
      }
    }
    absl::SleepFor(absl::Milliseconds(100));  // polls the files
  }
  ASSERT_FALSE(left.empty()) << "neither worker left within 90 s";
  std::printf("worker %s: %s\n", left.c_str(), why.c_str());
  EXPECT_NE(why.find("could not deliver"), std::string::npos) << why;
  const std::string stayed = left == "a" ? "b" : "a";
  auto exited = workers[left]->WaitFor(absl::Seconds(30));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) != 0) << *exited;
  EXPECT_FALSE(workers[stayed]->WaitFor(absl::ZeroDuration()).ok());  // it serves on

  // The job, which needs both, fails; the worker that stayed runs the next job.
  auto failure = job.WaitForLine("pathways train:", absl::Seconds(60));
  ASSERT_TRUE(failure.ok()) << failure.status();
  std::printf("the pipeline: %s\n", failure->c_str());
  EXPECT_NE(failure->find(absl::StrCat("host ", net.Address(left))), std::string::npos) << *failure;
  EXPECT_NE(failure->find("could not deliver"), std::string::npos) << *failure;  // why it left
  auto job_exit = job.WaitFor(absl::Seconds(30));
  ASSERT_TRUE(job_exit.ok()) << job_exit.status();
  EXPECT_FALSE(WIFEXITED(*job_exit) && WEXITSTATUS(*job_exit) == 0);
  auto alone = Tenant(net, address, 2);
  EXPECT_TRUE(Passed(alone)) << alone.second;

  // The network whole again, a new worker takes the place of the one that left.
  ASSERT_TRUE(net.SetReachable("a", "b", true).ok());
  ASSERT_TRUE(net.SetReachable("b", "a", true).ok());
  ASSERT_NO_FATAL_FAILURE(start_worker(fresh, left));
  auto after = Tenant(net, address, 4);
  EXPECT_TRUE(Passed(after)) << after.second;

  for (Subprocess* p : {&fresh, workers[stayed], &controller}) EXPECT_EQ(p->Stop(SIGTERM) & 0x7f, 0);
}

}  // namespace
}  // namespace pathways
