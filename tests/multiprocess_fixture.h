// The cluster as real processes on loopback, for tests: a controller and two workers started from
// the `pathways` binary (PATHWAYS_BINARY), driven by a client in the test's process.
#pragma once

#include <signal.h>
#include <sys/wait.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "core/types.h"
#include "client/client.h"
#include "client/program.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

namespace pathways {

inline constexpr absl::Duration kStartTimeout = absl::Seconds(60);

// f32 values of a small repeating pattern, times `scale`.
HostArray Pattern(Shape shape, float scale);

// A client's job on two devices (add_one on a put array) gives the right result.
void ExpectAJobOnTwoDevicesRuns(Client& client);

// Runs `pathways args...` to its end; its exit status and everything it printed.
std::pair<int, std::string> RunToEnd(const std::string& args);

// Expects a command run by RunToEnd to have failed, saying `says`.
void ExpectFailedSaying(const std::pair<int, std::string>& r, const std::string& says);

// A port no one listens on now (the kernel's pick, let go again).
int FreePort();

// A controller and two workers of 4 devices each (256 MiB), and a client of them.
class MultiProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Heartbeats every 250 ms, so status reflects work soon after it ran.
    ASSERT_TRUE(controller_.Start({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0",
                                   "--heartbeat-timeout-ms", "1000", "--client-timeout-ms", "1000"})
                    .ok());
    auto line = controller_.WaitForLine("listening on", kStartTimeout);
    ASSERT_TRUE(line.ok()) << line.status();
    address_ = line->substr(line->rfind(' ') + 1);
    for (auto* w : {&worker_a_, &worker_b_}) {
      ASSERT_TRUE(w->Start({PATHWAYS_BINARY, "worker", "--controller", address_, "--island", "0",
                            "--devices", "4", "--device-memory", "256MiB"})
                      .ok());
      auto ready = w->WaitForLine("serving", kStartTimeout);
      ASSERT_TRUE(ready.ok()) << ready.status();
      // "worker <address> serving ..."
      worker_addresses_.push_back(ready->substr(7, ready->find(' ', 7) - 7));
    }
    auto client = Client::Connect(address_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  void TearDown() override {
    client_.reset();
    for (auto* p : {&worker_a_, &worker_b_, &controller_}) {
      if (p->pid() > 0) {
        int status = p->Stop(SIGTERM);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit status " << status;
      }
    }
  }

  // A run whose first node (seconds of device work) is on one worker, the victim, and whose
  // second reads that node's output on the other, the survivor.
  struct RunAcrossWorkers {
    VirtualSlice on_victim, on_survivor;
    std::string victim;
    Subprocess* victim_process = nullptr;
    CompiledFunction inc;  // add_one on f32[128, 128]
    std::vector<ShardedArray> out;
  };
  void StartRunAcrossWorkers(RunAcrossWorkers& run) {
    run.on_victim = *client_->CreateSlice({.mesh_shape = {4}});  // placement fills host 0 first
    run.on_survivor = *client_->CreateSlice({.mesh_shape = {4}});
    ASSERT_EQ(run.on_victim.host_addresses().size(), 1u);
    ASSERT_EQ(run.on_survivor.host_addresses().size(), 1u);
    ASSERT_NE(run.on_victim.host_addresses()[0], run.on_survivor.host_addresses()[0]);
    run.victim = run.on_victim.host_addresses()[0];
    ASSERT_EQ(worker_addresses_.size(), 2u);
    run.victim_process = run.victim == worker_addresses_[0] ? &worker_a_ : &worker_b_;
    const TensorSpec m{DType::kF32, {128, 128}};
    auto slow = *client_->Compile(FunctionSpec::Script(
        "slow", "def slow(x):\n    for _ in range(40000):\n        x = torch.tanh(x @ x) * 0.5\n    return x\n",
        {m}, {m}, {{}}, {{}}));
    run.inc = *client_->Compile(FunctionSpec::Builtin("add_one", {m}, {m}, {{}}, {{}}));
    ProgramBuilder builder("across");
    TracedValue v = builder.Arg(m);
    v = (*builder.Call(slow, run.on_victim, {v}))[0];
    v = (*builder.Call(run.inc, run.on_survivor, {v}))[0];  // its input crosses from the victim
    Program program = *builder.Build({v});
    ShardedArray x = *client_->Put(Pattern({128, 128}, 0.01f), run.on_victim);
    run.out = *client_->Run(program, {x});
  }
  // The survivor runs a call on its slice.
  void ExpectTheSurvivorServes(const RunAcrossWorkers& run) {
    ShardedArray y = *client_->Put(Pattern({128, 128}, 1.0f), run.on_survivor);
    auto fine = client_->Fetch((*client_->Call(run.inc, run.on_survivor, {y}))[0]).AwaitFor(absl::Seconds(60));
    ASSERT_TRUE(fine.ok()) << fine.status();
    EXPECT_EQ(fine->data<float>()[1], Pattern({128, 128}, 1.0f).data<float>()[1] + 1);
  }
  // A worker started in the victim's place (as a supervisor would) serves a slice over its
  // devices and the survivor's, with blocks crossing between them.
  void ExpectAFreshWorkerServesWithTheSurvivor(const std::string& victim) {
    Subprocess fresh;
    ASSERT_TRUE(fresh.Start({PATHWAYS_BINARY, "worker", "--controller", address_, "--devices", "4"}).ok());
    ASSERT_TRUE(fresh.WaitForLine("serving", kStartTimeout).ok());
    auto wide = client_->CreateSlice({.mesh_shape = {8}});
    ASSERT_TRUE(wide.ok()) << wide.status();
    for (const std::string& h : wide->host_addresses()) EXPECT_NE(h, victim);
    const TensorSpec row{DType::kF32, {8}};
    auto inc8 = *client_->Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
    ShardedArray z = *client_->Put(Pattern({8}, 1.0f), *wide, {"x"});
    auto wide_result = client_->Fetch((*client_->Call(inc8, *wide, {z}))[0]).AwaitFor(absl::Seconds(60));
    ASSERT_TRUE(wide_result.ok()) << wide_result.status();
    EXPECT_EQ(wide_result->data<float>()[7], Pattern({8}, 1.0f).data<float>()[7] + 1);
    int exit_status = fresh.Stop(SIGTERM);
    EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0) << exit_status;
  }

  Subprocess controller_, worker_a_, worker_b_;
  std::string address_;
  std::vector<std::string> worker_addresses_;  // of worker_a_, worker_b_
  std::unique_ptr<Client> client_;
};

}  // namespace pathways
