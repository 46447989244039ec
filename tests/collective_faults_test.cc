// A collective group that loses a member mid-call, as real processes: a controller, two workers
// of 4 devices and a collective over all 8. The member left behind fails its run with a status
// naming the collective, its group, the hosts and the cause, within the collective timeout; the
// devices then run the next collective.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "multiprocess_fixture.h"
#include "testing/subprocess.h"
#include "transport/controller_client.h"

namespace pathways {
namespace {

constexpr int kCollectiveTimeoutMs = 3000;

class CollectiveFaultsTest : public ::testing::Test {
 protected:
  // By default a heartbeat timeout far past the collective's, so what fails the run is the
  // collective, not the controller declaring a frozen worker dead.
  explicit CollectiveFaultsTest(int heartbeat_timeout_ms = 60'000) : heartbeat_timeout_ms_(heartbeat_timeout_ms) {}
  void SetUp() override {
    Subprocess::KillEveryChildWhenParentEnds();  // a test that crashes leaves no cluster behind
    ASSERT_TRUE(controller_.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0", "--heartbeat-timeout-ms",
                                   std::to_string(heartbeat_timeout_ms_)})
                    .ok());
    auto line = controller_.WaitForLine("listening on", kStartTimeout);
    ASSERT_TRUE(line.ok()) << line.status();
    address_ = line->substr(line->rfind(' ') + 1);
    for (int w = 0; w < 2; ++w) addresses_.push_back(StartWorker(workers_[w], "127.0.0.1:0"));
    auto client = Client::Connect(address_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    client_.reset();
    for (Subprocess* p : {&workers_[0], &workers_[1], &replacement_, &controller_}) {
      if (p->pid() > 0) p->Terminate(absl::Seconds(30));
    }
  }

  // Starts a worker listening at `listen`; its address.
  std::string StartWorker(Subprocess& worker, const std::string& listen) {
    EXPECT_TRUE(worker
                    .Start({PATHWAYS_BINARY, "worker", "--controller", address_, "--listen", listen, "--devices", "4",
                            "--device-memory", "64MiB", "--collective-timeout-ms",
                            std::to_string(kCollectiveTimeoutMs)})
                    .ok());
    auto ready = worker.WaitForLine("serving", kStartTimeout);
    EXPECT_TRUE(ready.ok()) << ready.status();
    if (!ready.ok()) return "";
    return ready->substr(7, ready->find(' ', 7) - 7);  // "worker <address> serving ..."
  }

  // A slice of 8 devices over both workers, the worker that does not hold its device 0 (the
  // victim: the run's result is read from device 0) and its process.
  struct Gang {
    VirtualSlice slice;
    std::string victim;
    Subprocess* victim_process = nullptr;
    std::vector<float> input;  // 1 on the victim's first shard, 0 on the others
  };
  void MakeGang(Gang& gang) {
    auto slice = client_->CreateSlice({.mesh_shape = {8}, .axis_names = {"x"}});
    ASSERT_TRUE(slice.ok()) << slice.status();
    ASSERT_EQ(slice->host_addresses().size(), 2u);
    gang.slice = *slice;
    const std::string& first = slice->devices()[0].host_address;
    gang.victim = slice->host_addresses()[0] == first ? slice->host_addresses()[1] : slice->host_addresses()[0];
    ASSERT_TRUE(gang.victim == addresses_[0] || gang.victim == addresses_[1]) << gang.victim;
    gang.victim_process = gang.victim == addresses_[0] ? &workers_[0] : &workers_[1];
    for (const PhysicalDeviceInfo& d : slice->devices()) {
      const bool first = d.host_address == gang.victim &&
                         std::find(gang.input.begin(), gang.input.end(), 1.0f) == gang.input.end();
      gang.input.push_back(first ? 1 : 0);
    }
  }

  // One of the victim's members multiplies `iterations` 128x128 matrices before the all_reduce
  // (about 0.1 ms each); the others reach it at once and wait there. The (replicated) sum is read
  // from device 0 alone, which is not the victim's.
  CompiledFunction SlowOnTheVictim(int iterations) {
    return SumScript("slow_then_sum",
                     "def slow_then_sum(x):\n"
                     "    if bool(x.sum() > 0.5):\n"
                     "        m = torch.full([128, 128], 0.01)\n"
                     "        for _ in range(" +
                         std::to_string(iterations) +
                         "):\n"
                         "            m = torch.tanh(m @ m)\n"
                         "        x = x + m[0, 0:1] * 0.0\n"
                         "    return pathways.all_reduce(x, 'x')\n");
  }
  CompiledFunction Sum() { return SumScript("sum", "def sum(x):\n    return pathways.all_reduce(x, 'x')\n"); }
  // A script from the gang's 8 elements (one a device) to their replicated sum.
  CompiledFunction SumScript(const std::string& name, const std::string& source) {
    const TensorSpec all{DType::kF32, {8}}, sum{DType::kF32, {1}};
    auto f = client_->Compile(FunctionSpec::Script(name, source, {all}, {sum}, {{"x"}}, {{}}));
    EXPECT_TRUE(f.ok()) << f.status();
    return *f;
  }
  // The next collectives on the slice's devices give the right sum.
  void ExpectCollectivesRun(const VirtualSlice& slice) {
    const CompiledFunction sum = Sum();
    std::vector<float> ones(8, 1.0f);
    auto data = HostArray::FromVector<float>(DType::kF32, {8}, ones);
    ASSERT_TRUE(data.ok());
    auto x = client_->Put(*data, slice, {"x"});
    ASSERT_TRUE(x.ok()) << x.status();
    for (int round = 0; round < 3; ++round) {
      auto out = client_->Call(sum, slice, {*x});
      ASSERT_TRUE(out.ok()) << out.status();
      auto got = client_->Fetch((*out)[0]).AwaitFor(absl::Seconds(60));
      ASSERT_TRUE(got.ok()) << "round " << round << ": " << got.status();
      EXPECT_EQ(got->data<float>()[0], 8.0f);
    }
  }
  // Returns once every device of the gang has run what it was given before (each runs in order).
  void WaitForTheDevices(const Gang& gang) {
    const TensorSpec all{DType::kF32, {8}};
    auto inc = client_->Compile(FunctionSpec::Builtin("add_one", {all}, {all}, {{"x"}}, {{"x"}}));
    ASSERT_TRUE(inc.ok()) << inc.status();
    auto data = HostArray::FromVector<float>(DType::kF32, {8}, gang.input);
    ASSERT_TRUE(data.ok());
    auto x = client_->Put(*data, gang.slice, {"x"});
    ASSERT_TRUE(x.ok()) << x.status();
    auto out = client_->Call(*inc, gang.slice, {*x});
    ASSERT_TRUE(out.ok()) << out.status();
    auto done = client_->Fetch((*out)[0]).AwaitFor(absl::Seconds(120));
    ASSERT_TRUE(done.ok()) << done.status();
  }
  // Starts `f` on the gang's input; its output, once the run is pushed to the hosts.
  ShardedArray Start(const Gang& gang, const CompiledFunction& f) {
    auto data = HostArray::FromVector<float>(DType::kF32, {8}, gang.input);
    EXPECT_TRUE(data.ok());
    auto x = client_->Put(*data, gang.slice, {"x"});
    EXPECT_TRUE(x.ok()) << x.status();
    auto out = client_->Call(f, gang.slice, {*x});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    EXPECT_TRUE(client_->Enqueued((*out)[0]).Await().ok());
    return (*out)[0];
  }
  // A gang whose hosts' connections are made (a first collective ran), and a run on it whose
  // victim's member computes for `iterations` before the all_reduce: its output.
  ShardedArray StartWithTheVictimSlow(Gang& gang, int iterations) {
    MakeGang(gang);
    if (HasFatalFailure()) return {};
    ExpectCollectivesRun(gang.slice);
    if (HasFatalFailure()) return {};
    return Start(gang, SlowOnTheVictim(iterations));
  }
  // Waits until a heartbeat of `host` sent from now on says `members` of its devices are inside a
  // collective (an earlier one may have seen an earlier collective's members).
  void WaitForMembersInACollective(const std::string& host, int64_t members) {
    ControllerClient controller(address_);
    const absl::Time since = absl::Now();
    int64_t seen = -1;
    for (absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
      auto status = controller.GetStatus();
      ASSERT_TRUE(status.ok()) << status.status();
      for (const rpc::HostStatus& h : status->hosts()) {
        const absl::Time sent = absl::Now() - absl::Milliseconds(h.millis_since_heartbeat());
        if (h.address() == host && sent > since) seen = h.counters().collectives_in_progress();
      }
      if (seen >= members) return;
      absl::SleepFor(absl::Milliseconds(50));  // between polls (heartbeats come every 500 ms)
    }
    FAIL() << "host " << host << " never had " << members << " members in a collective (last seen: " << seen << ")";
  }
  void ExpectTheCollectiveNamed(const absl::Status& s, const std::string& victim) {
    EXPECT_NE(s.message().find("collective all_reduce(f32[1], sum) over [x] (8 members)"), std::string::npos) << s;
    EXPECT_NE(s.message().find(victim), std::string::npos) << s;
  }

  const int heartbeat_timeout_ms_;
  Subprocess controller_, workers_[2], replacement_;
  std::string address_;
  std::vector<std::string> addresses_;  // the workers'

  std::unique_ptr<Client> client_;
};

// A member frozen (SIGSTOP) while the others wait in the collective: they fail at the collective
// timeout, naming it, its group and the frozen host; once it wakes, the same 8 devices run the
// next collectives.
TEST_F(CollectiveFaultsTest, AFrozenMemberFailsTheCollectiveAtItsTimeoutAndTheDevicesGoOn) {
  // Frozen while its slow member computes (runs are scheduled in rounds every host of the island
  // takes, so a host frozen before the run came would hold up the run itself, not the collective).
  Gang gang;
  ShardedArray out;
  ASSERT_NO_FATAL_FAILURE(out = StartWithTheVictimSlow(gang, 20000));
  ASSERT_EQ(kill(gang.victim_process->pid(), SIGSTOP), 0);
  const absl::Time frozen = absl::Now();
  auto result = client_->Fetch(out).AwaitFor(absl::Seconds(60));
  const absl::Duration took = absl::Now() - frozen;
  ASSERT_EQ(kill(gang.victim_process->pid(), SIGCONT), 0);
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(result.status())) << result.status();
  ExpectTheCollectiveNamed(result.status(), gang.victim);
  EXPECT_NE(result.status().message().find("still waiting for host(s) " + gang.victim), std::string::npos)
      << result.status();
  EXPECT_LT(took, absl::Milliseconds(kCollectiveTimeoutMs) + absl::Seconds(5)) << result.status();
  // Woken, the victim finishes its member's work and the failed call (its devices run in order:
  // a function without a collective on the same devices ends after it), then the same devices
  // run the next collectives.
  ASSERT_NO_FATAL_FAILURE(WaitForTheDevices(gang));
  ASSERT_NO_FATAL_FAILURE(ExpectCollectivesRun(gang.slice));
}

// Every member on one host fails in its body before the collective (a kernel error): the members
// on the other host, waiting for that host in the call, ask it and fail naming the failed shard
// and the cause, not at the collective timeout ("still waiting for host(s) ... at the deadline");
// the devices then run the next collectives.
TEST_F(CollectiveFaultsTest, AHostWhoseMembersAllFailedBeforeTheCollectiveIsNotWaitedFor) {
  Gang gang;
  ASSERT_NO_FATAL_FAILURE(MakeGang(gang));
  ASSERT_NO_FATAL_FAILURE(ExpectCollectivesRun(gang.slice));  // connected, as after any first call
  for (size_t d = 0; d < gang.input.size(); ++d) {
    gang.input[d] = gang.slice.devices()[d].host_address == gang.victim ? 1 : 0;
  }
  const CompiledFunction fails_there = SumScript("fails_there",
                                                 "def fails_there(x):\n"
                                                 "    if bool(x.sum() > 0.5):\n"
                                                 "        x = x + (torch.ones([2]) + torch.ones([3]))[0:1]\n"
                                                 "    return pathways.all_reduce(x, 'x')\n");
  ASSERT_FALSE(HasFailure());
  const absl::Time start = absl::Now();
  auto result = client_->Fetch(Start(gang, fails_there)).AwaitFor(absl::Seconds(60));
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(result.ok());
  ExpectTheCollectiveNamed(result.status(), gang.victim);
  EXPECT_NE(result.status().message().find("of this gang on host " + gang.victim + " will not come"), std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("must match the size"), std::string::npos) << result.status();
  std::cout << "the survivors failed " << absl::FormatDuration(took) << " after the call (collective timeout "
            << kCollectiveTimeoutMs << " ms)\n";
  ASSERT_NO_FATAL_FAILURE(ExpectCollectivesRun(gang.slice));
}

// A heartbeat timeout of 2 s, so that a worker can start in a killed one's place soon.
class KilledMemberTest : public CollectiveFaultsTest {
 protected:
  KilledMemberTest() : CollectiveFaultsTest(2000) {}
};

// A member killed (SIGKILL) while the others wait in the collective: its connections close, so
// they fail at once (not at the collective timeout), naming the collective, its group and the
// host that closed; once the controller has declared it dead, a worker started at its address
// (as a supervisor would) runs the next collectives with the survivor.
TEST_F(KilledMemberTest, AKilledMemberFailsTheCollectiveAtOnceAndAWorkerInItsPlaceGoesOn) {
  // The victim's member computes for seconds; the survivor's four members are in the collective
  // before the kill, as its heartbeat says (one that came to the call only after it would wait the
  // collective timeout for a connection instead, and this test would fail).
  Gang gang;
  ShardedArray out;
  ASSERT_NO_FATAL_FAILURE(out = StartWithTheVictimSlow(gang, 40000));
  const std::string survivor = gang.victim == addresses_[0] ? addresses_[1] : addresses_[0];
  ASSERT_NO_FATAL_FAILURE(WaitForMembersInACollective(survivor, 4));
  gang.victim_process->Stop(SIGKILL);
  const absl::Time killed = absl::Now();
  auto result = client_->Fetch(out).AwaitFor(absl::Seconds(60));
  const absl::Duration took = absl::Now() - killed;
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsUnavailable(result.status())) << result.status();
  ExpectTheCollectiveNamed(result.status(), gang.victim);
  EXPECT_NE(result.status().message().find("host " + gang.victim + " closed the connection"), std::string::npos)
      << result.status();
  EXPECT_LT(took, absl::Milliseconds(kCollectiveTimeoutMs)) << "a closed connection is seen at once: "
                                                            << result.status();

  bool dead = false;
  for (absl::Time until = absl::Now() + absl::Seconds(60); !dead && absl::Now() < until;) {
    auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
    dead = status.ok() && status->find("DEAD") != std::string::npos;
    if (!dead) absl::SleepFor(absl::Milliseconds(200));  // between polls
  }
  ASSERT_TRUE(dead) << "the controller never declared " << gang.victim << " dead";
  ASSERT_EQ(StartWorker(replacement_, gang.victim), gang.victim);
  auto slice = client_->CreateSlice({.mesh_shape = {8}, .axis_names = {"x"}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  ASSERT_NO_FATAL_FAILURE(ExpectCollectivesRun(*slice));
}

}  // namespace
}  // namespace pathways
