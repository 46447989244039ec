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
#include "testing/subprocess.h"

namespace pathways {
namespace {

constexpr absl::Duration kStartTimeout = absl::Seconds(60);

// Runs a shell command to its end; its status and output.
std::pair<int, std::string> Sh(const std::string& command) { return RunShell(command, absl::Seconds(120)); }

// The namespaces and links of one test, removed (with the processes' sockets in them) when it ends.
class Network {
 public:
  // One namespace per member, each with address 10.<subnet>.0.<i + 1>/24 on a shared bridge.
  explicit Network(const std::vector<std::string>& members) {
    prefix_ = absl::StrCat("pw", getpid() % 100000);
    subnet_ = static_cast<int>(getpid() % 200) + 20;
    ok_ = Run({absl::StrCat("ip netns add ", Ns("sw")), absl::StrCat("ip -n ", Ns("sw"), " link add br0 type bridge"),
               absl::StrCat("ip -n ", Ns("sw"), " link set br0 up")});
    namespaces_.push_back(Ns("sw"));
    for (size_t i = 0; ok_ && i < members.size(); ++i) {
      const std::string& m = members[i];
      namespaces_.push_back(Ns(m));
      addresses_[m] = absl::StrCat("10.", subnet_, ".0.", i + 1);
      ok_ = Run({absl::StrCat("ip netns add ", Ns(m)),
                 absl::StrCat("ip link add e", m, " netns ", Ns(m), " type veth peer name ", Port(m), " netns ", Ns("sw")),
                 absl::StrCat("ip -n ", Ns(m), " addr add ", addresses_[m], "/24 dev e", m),
                 absl::StrCat("ip -n ", Ns(m), " link set e", m, " up"), absl::StrCat("ip -n ", Ns(m), " link set lo up"),
                 absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(m), " master br0"),
                 absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(m), " up")});
    }
  }
  ~Network() {
    for (const std::string& ns : namespaces_) Sh(absl::StrCat("ip netns del ", ns));
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string Ns(const std::string& member) const { return absl::StrCat(prefix_, member); }
  std::string Address(const std::string& member) { return addresses_[member]; }
  // `member`'s port on the bridge: down drops everything to and from it, silently.
  absl::Status SetConnected(const std::string& member, bool up) {
    auto [status, out] = Sh(absl::StrCat("ip -n ", Ns("sw"), " link set ", Port(member), up ? " up" : " down"));
    if (status != 0) return absl::InternalError(out);
    return absl::OkStatus();
  }
  // argv run inside `member`'s namespace (`ip netns exec` execs it: same process id).
  std::vector<std::string> In(const std::string& member, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {IpCommand(), "netns", "exec", Ns(member)});
    return argv;
  }
  // Where the ip command is (Subprocess does not search the PATH).
  static std::string IpCommand() { return access("/usr/sbin/ip", X_OK) == 0 ? "/usr/sbin/ip" : "/sbin/ip"; }

 private:
  std::string Port(const std::string& member) const { return absl::StrCat(prefix_, "p", member); }
  bool Run(const std::vector<std::string>& commands) {
    for (const std::string& c : commands) {
      auto [status, out] = Sh(c);
      if (status != 0) {
        error_ = absl::StrCat(c, ": ", out);
        return false;
      }
    }
    return true;
  }
  std::string prefix_;
  int subnet_ = 0;
  bool ok_ = false;
  std::string error_;
  std::vector<std::string> namespaces_;
  std::map<std::string, std::string> addresses_;
};

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
  if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  if (Sh("ip netns list").first != 0) GTEST_SKIP() << "the ip command (iproute2) cannot manage network namespaces";
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
