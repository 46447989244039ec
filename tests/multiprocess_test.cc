// The cluster as real processes on loopback: a controller and two workers started from the
// `pathways` binary, driven by a client in this process.

#include <signal.h>
#include <sys/wait.h>

#include <cstring>
#include <fstream>

#include "client/client.h"
#include "client/program.h"
#include "compute/executable.h"
#include "compute/function_cache.h"
#include "device/cpu_device.h"
#include "gtest/gtest.h"
#include "multiprocess_fixture.h"
#include "testing/subprocess.h"
#include "transport/controller_client.h"
#include "transport/worker_client.h"

namespace pathways {
namespace {

// libtorch on one local device: the reference the cluster's result is compared with.
HostArray Reference(const FunctionBody& body, const std::vector<const HostArray*>& inputs,
                    const TensorSpec& output) {
  FunctionCache cache;
  CpuDevice device(0, int64_t{1} << 30, "reference");
  auto exe = *cache.Compile(body);
  std::vector<BufferPtr> in;
  std::vector<const DeviceBuffer*> ptrs;
  for (const HostArray* h : inputs) {
    BufferPtr b = *device.Allocate(h->dtype(), h->shape());
    std::memcpy(b->data(), h->bytes().data(), h->bytes().size());
    ptrs.push_back(b.get());
    in.push_back(std::move(b));
  }
  BufferPtr out = *device.Allocate(output.dtype, output.shape);
  DeviceBuffer* out_ptr = out.get();
  EXPECT_TRUE(exe->Run(ptrs, {&out_ptr, 1}).ok());
  return *HostArray::FromBytes(output.dtype, output.shape, std::string(out->data(), out->byte_size()));
}

TEST_F(MultiProcessTest, StatusListsIslandsHostsAndDevices) {
  auto out = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_NE(out->find("1 islands, 2 hosts"), std::string::npos) << *out;
  EXPECT_NE(out->find("island 0"), std::string::npos) << *out;
  EXPECT_NE(out->find("device 7"), std::string::npos) << *out;
  EXPECT_NE(out->find("/ 268435456 bytes"), std::string::npos) << *out;
}

TEST_F(MultiProcessTest, ShardedMatmulOverTwoHostsThenChainMatchesLibtorch) {
  auto slice = client_->CreateSlice({.mesh_shape = {8}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  ASSERT_EQ(slice->host_addresses().size(), 2u);
  const TensorSpec a_spec{DType::kF32, {64, 32}}, b_spec{DType::kF32, {32, 24}}, c_spec{DType::kF32, {64, 24}};
  HostArray a = Pattern(a_spec.shape, 0.25f), b = Pattern(b_spec.shape, 0.5f);
  auto fa = client_->Put(a, *slice, {"x", ""});
  auto fb = client_->Put(b, *slice, {});
  ASSERT_TRUE(fa.ok() && fb.ok());
  auto matmul = client_->Compile(FunctionSpec::Builtin("matmul", {a_spec, b_spec}, {c_spec},
                                                       {{"x", ""}, {}}, {{"x", ""}}));
  ASSERT_TRUE(matmul.ok()) << matmul.status();
  const char* kSource = "def scaled_tanh(c):\n    return torch.tanh(c * 0.05) * 3.0\n";
  // Split by columns: every shard of the chained call needs rows from both hosts.
  auto chain = client_->Compile(FunctionSpec::Script("scaled_tanh", kSource, {c_spec}, {c_spec},
                                                     {{"", "x"}}, {{"", "x"}}));
  ASSERT_TRUE(chain.ok()) << chain.status();
  auto c = client_->Call(*matmul, *slice, {*fa, *fb});
  ASSERT_TRUE(c.ok()) << c.status();
  auto d = client_->Call(*chain, *slice, {(*c)[0]});
  ASSERT_TRUE(d.ok()) << d.status();
  auto result = client_->Fetch((*d)[0]).Await();
  ASSERT_TRUE(result.ok()) << result.status();

  // `pathways status` shows this client's share of device time once the workers report it
  // (bounded wait: heartbeats carry it every 250 ms here).
  bool reported = false;
  for (absl::Time deadline = absl::Now() + absl::Seconds(20); !reported && absl::Now() < deadline;) {
    auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << status.status();
    // Others' ids are not shown: a client is labelled by the first digits of its id.
    reported = status->find("client " + client_->id().substr(0, 8)) != std::string::npos;
  }
  EXPECT_TRUE(reported);

  HostArray ref_c = Reference({FunctionBody::Kind::kBuiltin, "matmul", ""}, {&a, &b}, c_spec);
  HostArray ref_d = Reference({FunctionBody::Kind::kTorchScript, "scaled_tanh", kSource}, {&ref_c}, c_spec);
  for (int64_t i = 0; i < result->num_elements(); ++i) {
    ASSERT_NEAR(result->data<float>()[i], ref_d.data<float>()[i], 1e-5) << "element " << i;
  }
}

TEST_F(MultiProcessTest, BadRequestsFailClearlyAndProcessesKeepServing) {
  auto slice = *client_->CreateSlice({.mesh_shape = {8}});
  auto fn = *client_->Compile(FunctionSpec::Builtin("add", {{DType::kF32, {8}}, {DType::kF32, {8}}},
                                                    {{DType::kF32, {8}}}, {{"x"}, {"x"}}, {{"x"}}));
  auto good = *client_->Put(Pattern({8}, 1.0f), slice, {"x"});
  auto wrong_shape = *client_->Put(Pattern({16}, 1.0f), slice, {"x"});
  auto wrong_dtype = *client_->Put(*HostArray::Create(DType::kI32, {8}), slice, {"x"});

  EXPECT_EQ(client_->Call(fn, slice, {good, wrong_shape}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Call(fn, slice, {wrong_dtype, good}).status().code(), absl::StatusCode::kInvalidArgument);
  auto unknown = client_->Compile(FunctionSpec::Builtin("not_a_kernel", {}, {}));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  auto syntax = client_->Compile(FunctionSpec::Script("oops", "def oops(x):\n    return (x\n",
                                                      {{DType::kF32, {8}}}, {{DType::kF32, {8}}}));
  EXPECT_EQ(syntax.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(syntax.status().message().find("'oops'"), std::string::npos) << syntax.status();
  EXPECT_NE(syntax.status().message().find("line"), std::string::npos) << syntax.status();
  auto too_big = client_->CreateSlice({.mesh_shape = {4, 4}});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();

  // Still serving: a correct call on both hosts.
  auto sum = client_->Call(fn, slice, {good, good});
  ASSERT_TRUE(sum.ok()) << sum.status();
  auto result = client_->Fetch((*sum)[0]).Await();
  ASSERT_TRUE(result.ok()) << result.status();
  HostArray expected = Pattern({8}, 1.0f);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(result->data<float>()[i], 2 * expected.data<float>()[i]);
}

// Collectives across worker processes: collective links found through the controller.
TEST_F(MultiProcessTest, CollectivesOverAMeshSpanningTwoProcesses) {
  auto slice = client_->CreateSlice({.mesh_shape = {2, 4}, .axis_names = {"x", "y"}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  ASSERT_EQ(slice->host_addresses().size(), 2u);
  const TensorSpec in{DType::kF32, {8, 8}}, gathered{DType::kF32, {8, 8}};
  const FunctionBody body{FunctionBody::Kind::kTorchScript, "mix",
                          "def mix(x):\n"
                          "    s = pathways.all_reduce(x, 'x,y')\n"
                          "    return pathways.all_gather(s + pathways.all_reduce(x, 'y', 'max'), 'y', 1)\n"};
  auto fn = client_->Compile({body, {in}, {gathered}, {{"x", "y"}}, {{"x", ""}}});
  ASSERT_TRUE(fn.ok()) << fn.status();
  HostArray data = Pattern({8, 8}, 0.5f);
  auto x = client_->Put(data, *slice, {"x", "y"});
  ASSERT_TRUE(x.ok()) << x.status();
  for (int round = 0; round < 3; ++round) {
    auto out = client_->Call(*fn, *slice, {*x});
    ASSERT_TRUE(out.ok()) << out.status();
    auto got = client_->Fetch((*out)[0]).Await();
    ASSERT_TRUE(got.ok()) << got.status();
    // Shard (i, j) holds block rows 4i..4i+3, columns 2j..2j+1. Row r of the result is
    // sum-of-all-blocks + max over j of row i's blocks, laid out block after block along y.
    auto at = [&](int64_t r, int64_t c) { return data.data<float>()[r * 8 + c]; };
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t a = 0; a < 4; ++a) {  // row within a block
        for (int64_t j = 0; j < 4; ++j) {
          for (int64_t b = 0; b < 2; ++b) {
            float sum = 0, max = -1e30f;
            for (int64_t bi = 0; bi < 2; ++bi) {
              for (int64_t bj = 0; bj < 4; ++bj) sum += at(bi * 4 + a, bj * 2 + b);
            }
            for (int64_t bj = 0; bj < 4; ++bj) max = std::max(max, at(i * 4 + a, bj * 2 + b));
            const float want = sum + max;
            EXPECT_FLOAT_EQ(got->data<float>()[(i * 4 + a) * 8 + j * 2 + b], want) << i << a << j << b;
          }
        }
      }
    }
  }
}

// Members of a collective that disagree on its shape or its dtype, across processes: the run
// fails at once with a status naming the collective, its group and the cause, and the same
// devices then run the next collective normally.
TEST_F(MultiProcessTest, CollectiveMembersThatDisagreeFailTheRunAndTheNextCollectivePasses) {
  auto slice = client_->CreateSlice({.mesh_shape = {2, 4}, .axis_names = {"x", "y"}});
  ASSERT_TRUE(slice.ok()) << slice.status();
  const TensorSpec spec{DType::kF32, {2, 4}};
  // Shards holding a positive value contribute two elements, the others one.
  auto bad = client_->Compile({{FunctionBody::Kind::kTorchScript, "uneven",
                                "def uneven(x):\n"
                                "    y = x\n"
                                "    if bool(x.sum() > 0.5):\n"
                                "        y = torch.cat([x, x])\n"
                                "    return pathways.all_reduce(y, 'x')[0:1]\n"},
                               {spec}, {spec}, {{"x", "y"}}, {{"x", "y"}}});
  ASSERT_TRUE(bad.ok()) << bad.status();
  // Shards holding a positive value reduce int32, the others float32: the same bytes.
  auto retyped = client_->Compile({{FunctionBody::Kind::kTorchScript, "retyped",
                                    "def retyped(x):\n"
                                    "    y = x\n"
                                    "    if bool(x.sum() > 0.5):\n"
                                    "        y = x.int()\n"
                                    "    return pathways.all_reduce(y, 'x').float()\n"},
                                   {spec}, {spec}, {{"x", "y"}}, {{"x", "y"}}});
  ASSERT_TRUE(retyped.ok()) << retyped.status();
  auto good = client_->Compile({{FunctionBody::Kind::kTorchScript, "even",
                                 "def even(x):\n    return pathways.all_reduce(x, 'x')\n"},
                                {spec}, {spec}, {{"x", "y"}}, {{"x", "y"}}});
  ASSERT_TRUE(good.ok()) << good.status();
  auto data = HostArray::FromVector<float>(DType::kF32, {2, 4}, {0, 0, 0, 0, 1, 1, 1, 1});
  ASSERT_TRUE(data.ok());
  auto x = client_->Put(*data, *slice, {"x", "y"});
  ASSERT_TRUE(x.ok()) << x.status();
  const absl::Time start = absl::Now();
  auto failed = client_->Call(*bad, *slice, {*x});
  ASSERT_TRUE(failed.ok()) << failed.status();
  auto result = client_->Fetch((*failed)[0]).Await();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("all_reduce"), std::string::npos) << result.status();
  EXPECT_NE(result.status().message().find("disagree"), std::string::npos) << result.status();
  EXPECT_NE(result.status().message().find("over [x] at y="), std::string::npos) << result.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "a disagreement is found by size, not by a timeout";
  auto retyped_out = client_->Call(*retyped, *slice, {*x});
  ASSERT_TRUE(retyped_out.ok()) << retyped_out.status();
  result = client_->Fetch((*retyped_out)[0]).Await();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_NE(result.status().message().find("members disagree on the collective, its dtype or its shape"),
            std::string::npos)
      << result.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20)) << "a disagreement is found by signature, not by a timeout";
  for (int round = 0; round < 3; ++round) {
    auto out = client_->Call(*good, *slice, {*x});
    ASSERT_TRUE(out.ok()) << out.status();
    auto sum = client_->Fetch((*out)[0]).Await();
    ASSERT_TRUE(sum.ok()) << sum.status();
    for (int i = 0; i < 8; ++i) EXPECT_EQ(sum->data<float>()[i], 1.0f) << i;
  }
}

// Multi-tenancy with real processes: three client processes run gang programs on the same eight
// devices at once; each checks its own results, and status shows each one's share.
TEST_F(MultiProcessTest, TenantsInSeparateProcessesShareTheDevices) {
  Subprocess tenants[3];
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(tenants[i].Start({PATHWAYS_BINARY, "tenant", "--controller", address_, "--devices", "8", "--runs",
                                  "150", "--value", std::to_string(i + 1)})
                    .ok());
  }
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    auto line = tenants[i].WaitForLine("CHECK PASSED", absl::Seconds(120));
    ASSERT_TRUE(line.ok()) << "tenant " << i << ": " << line.status();
    // "tenant <id>: 150 runs, every result <v>: CHECK PASSED"
    EXPECT_NE(line->find(absl::StrCat("every result ", (i + 1) * 72, ":")), std::string::npos) << *line;
    ids.push_back(line->substr(7, line->find(':') - 7).substr(0, 8));  // status shows clients by label
    int status = tenants[i].Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "exit status " << status;
  }
  // Heartbeats carry each client's device time to the controller within a few hundred ms (a
  // loaded machine may take seconds; the poll is bounded at 200 tries).
  std::string out;
  for (int attempt = 0; attempt < 200; ++attempt) {
    auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << status.status();
    out = *status;
    bool all = true;
    for (const std::string& id : ids) all = all && out.find(id) != std::string::npos;
    if (all) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (const std::string& id : ids) EXPECT_NE(out.find(id), std::string::npos) << id << " not in\n" << out;
}

// A worker killed mid-run: the run that needed it fails with Unavailable naming the host, in
// bounded time; work on the other worker goes on; the controller takes the dead worker out; a
// worker started afterwards serves new slices.
TEST_F(MultiProcessTest, AWorkerKilledMidRunFailsItsRunsAndTheRestGoOn) {
  RunAcrossWorkers run;
  ASSERT_NO_FATAL_FAILURE(StartRunAcrossWorkers(run));
  absl::SleepFor(absl::Milliseconds(500));  // the run is on the victim's devices by now
  run.victim_process->Stop(SIGKILL);

  const absl::Time killed = absl::Now();
  auto result = client_->Fetch(run.out[0]).AwaitFor(absl::Seconds(30));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));  // bounded: heartbeat timeout (1 s) and a beat
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  EXPECT_NE(result.status().message().find(run.victim), std::string::npos) << result.status();

  ASSERT_NO_FATAL_FAILURE(ExpectTheSurvivorServes(run));
  auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", address_}, absl::Seconds(30));
  ASSERT_TRUE(status.ok());
  EXPECT_NE(status->find("DEAD"), std::string::npos) << *status;
  ExpectAFreshWorkerServesWithTheSurvivor(run.victim);
}

// A worker frozen (SIGSTOP) mid-run, not dead: the run that needs it fails while it is still
// frozen, naming it; when it wakes it learns it was declared dead and leaves; the survivor and
// a worker that joins afterwards serve the next jobs.
TEST_F(MultiProcessTest, AFrozenWorkerFailsItsRunsInBoundedTimeAndLeavesWhenItWakes) {
  RunAcrossWorkers run;
  ASSERT_NO_FATAL_FAILURE(StartRunAcrossWorkers(run));
  ASSERT_TRUE(client_->Enqueued(run.out[0]).Await().ok());
  ASSERT_EQ(kill(run.victim_process->pid(), SIGSTOP), 0);

  // Fails, and while the victim is still frozen (it stays so for up to 60 s here).
  auto result = client_->Fetch(run.out[0]).AwaitFor(absl::Seconds(60));
  ASSERT_FALSE(result.ok());
  EXPECT_TRUE(absl::IsUnavailable(result.status()) || absl::IsDeadlineExceeded(result.status())) << result.status();
  EXPECT_NE(result.status().message().find(run.victim), std::string::npos) << result.status();
  EXPECT_FALSE(run.victim_process->WaitFor(absl::ZeroDuration()).ok());  // still there, still frozen

  ASSERT_NO_FATAL_FAILURE(ExpectTheSurvivorServes(run));  // meanwhile

  // Woken, the victim is told it was declared dead, and leaves with an error.
  ASSERT_EQ(kill(run.victim_process->pid(), SIGCONT), 0);
  auto exited = run.victim_process->WaitFor(absl::Seconds(60));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(WIFEXITED(*exited) && WEXITSTATUS(*exited) != 0) << *exited;
  ExpectAFreshWorkerServesWithTheSurvivor(run.victim);
}

// A worker killed and started again at the same address: the client's arrays there are reported
// gone (not waited for), the slice is reported lost, and once remapped the same client uses the
// restarted worker again (a new sequence of ops for it; the new process knows nothing of the old).
TEST_F(MultiProcessTest, AWorkerRestartedAtTheSameAddressServesTheSameClientAgain) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {8}});
  ASSERT_EQ(slice.host_addresses().size(), 2u);
  const TensorSpec row{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(Pattern({8}, 1.0f), slice, {"x"});
  ASSERT_TRUE(client_->Fetch((*client_->Call(inc, slice, {x}))[0]).Await().ok());

  const std::string address = worker_addresses_[0];
  worker_a_.Stop(SIGKILL);
  // A fetch while it is down fails, and leaves the client's channel to that address waiting
  // between connection attempts: the fetch after the restart must still reach the new process.
  auto down = client_->Fetch(x).AwaitFor(absl::Seconds(30));
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  ASSERT_TRUE(worker_a_.Start({PATHWAYS_BINARY, "worker", "--controller", address_, "--listen", address, "--devices",
                               "4", "--device-memory", "256MiB"})
                  .ok());
  ASSERT_TRUE(worker_a_.WaitForLine("serving", kStartTimeout).ok());

  // What the old process held is gone, and the client is told so at once.
  auto old = client_->Fetch(x).AwaitFor(absl::Seconds(30));
  ASSERT_FALSE(old.ok());
  EXPECT_EQ(old.status().code(), absl::StatusCode::kUnavailable) << old.status();
  EXPECT_NE(old.status().message().find("restarted"), std::string::npos) << old.status();
  auto lost = *client_->LostSlices();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_NE(lost[0].reason.find("restarted"), std::string::npos) << lost[0].reason;

  ASSERT_TRUE(client_->RemapSlice(slice).ok());
  ShardedArray y = *client_->Put(Pattern({8}, 2.0f), slice, {"x"});
  auto call = client_->Call(inc, slice, {y});
  ASSERT_TRUE(call.ok()) << call.status();
  auto again = client_->Fetch((*call)[0]).AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(again.ok()) << again.status();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(again->data<float>()[i], Pattern({8}, 2.0f).data<float>()[i] + 1);
}

// A tenant's function that never ends would hold its device (a stream is non-preemptible), and so
// every later gang of the island on that host, while the process answers heartbeats. The worker
// sees the device make no progress past its computation timeout and asks the computation to stop:
// the body stops at its loop's next turn, the call fails with the reason, and the worker serves on.
// The controller refuses that client from then on (it would hold the next device as long) and
// collects what it held, and the cluster serves another client's job. With a token per tenant
// (--tenants), the client's whole tenant is refused: its other clients, and any it connects anew;
// and the refusal outlives a restart of the controller. (A computation that does not stop when
// asked takes its worker out of the cluster: SimulatedDevicesTest.AKernelThatDoesNotStop...)
TEST(StuckDeviceTest, AComputationPastTheTimeoutIsStoppedItsTenantRefusedAndTheWorkerServesOn) {
  const std::string tenants = ::testing::TempDir() + "/pathways_stuck_tenants";
  const std::string spinner_token = "spinner-0123456789abcdef", other_token = "other-0123456789abcdef";
  {
    std::ofstream file(tenants);
    file << "# name token\nspinner " << spinner_token << "\nother " << other_token << "\n";
  }
  const std::vector<std::string> guard = {"--cluster-token", "hosts-0123456789abcdef", "--tenants", tenants};
  auto with_guard = [&guard](std::vector<std::string> args) {
    args.insert(args.end(), guard.begin(), guard.end());
    return args;
  };
  Subprocess controller, spinning, other;
  auto address = StartController(controller, with_guard({PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0",
                                                         "--heartbeat-timeout-ms", "5000", "--client-timeout-ms",
                                                         "1000"}));
  ASSERT_TRUE(address.ok()) << address.status();
  // The spinning devices load both cores of a small machine for seconds: heartbeats may be late.
  // Registered first, so a slice of two devices is placed on it.
  ASSERT_TRUE(StartWorker(spinning, with_guard({PATHWAYS_BINARY, "worker", "--controller", *address, "--devices", "2",
                                                "--collective-timeout-ms", "1000", "--memory-wait-ms", "500",
                                                "--computation-timeout-ms", "3000"}))
                  .ok());
  ASSERT_TRUE(
      StartWorker(other, with_guard({PATHWAYS_BINARY, "worker", "--controller", *address, "--devices", "2"})).ok());
  auto client = Client::Connect(*address, {.token = spinner_token});
  ASSERT_TRUE(client.ok()) << client.status();
  VirtualSlice slice = *(*client)->CreateSlice({.mesh_shape = {2}});
  // A second client of the same tenant, alive throughout, with a schedule stream open (its first
  // call) before the refusal; its slice goes to the other worker, the first one's devices taken.
  auto sibling = Client::Connect(*address, {.token = spinner_token});
  ASSERT_TRUE(sibling.ok()) << sibling.status();
  const TensorSpec pair{DType::kF32, {2}};
  VirtualSlice sibling_slice = *(*sibling)->CreateSlice({.mesh_shape = {2}});
  auto inc = (*sibling)->Compile(
      FunctionSpec::Script("inc", "def inc(x):\n    return x + 1.0\n", {pair}, {pair}, {{"x"}}, {{"x"}}));
  ASSERT_TRUE(inc.ok()) << inc.status();
  ShardedArray sibling_x = *(*sibling)->Put(Pattern({2}, 1.0f), sibling_slice, {"x"});
  auto first = (*sibling)->Call(*inc, sibling_slice, {sibling_x});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*sibling)->Fetch((*first)[0]).AwaitFor(absl::Seconds(30)).ok());
  const TensorSpec row{DType::kF32, {2}};
  auto spin = (*client)->Compile(FunctionSpec::Script(
      "spin", "def spin(x):\n    for _ in range(1000000000):\n        x = x * 1.0\n    return x\n", {row}, {row},
      {{"x"}}, {{"x"}}));
  ASSERT_TRUE(spin.ok()) << spin.status();
  ShardedArray x = *(*client)->Put(Pattern({2}, 1.0f), slice, {"x"});
  auto call = (*client)->Call(*spin, slice, {x});
  ASSERT_TRUE(call.ok()) << call.status();
  auto got = (*client)->Fetch((*call)[0]).AwaitFor(absl::Seconds(60));
  ASSERT_FALSE(got.ok()) << "a computation of 10^9 steps finished";
  // Stopped (or, were the refusal first, collected), with the worker's reason.
  EXPECT_NE(got.status().message().find("past the worker's computation timeout"), std::string::npos) << got.status();
  // The spinning client is refused, whatever it asks, with the reason.
  auto lost = (*client)->LostSlices();
  ASSERT_EQ(lost.status().code(), absl::StatusCode::kFailedPrecondition) << lost.status();
  for (const char* part : {"refuses tenant spinner", "'spin'", "computation timeout of 3s", "asked it to stop"}) {
    EXPECT_NE(lost.status().message().find(part), std::string::npos) << part << " in: " << lost.status();
  }
  auto again = (*client)->CreateSlice({.mesh_shape = {2}});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  // And so is its tenant: the other client (on its open stream too), and a new one.
  auto scheduled = (*sibling)->Call(*inc, sibling_slice, {sibling_x});
  absl::Status call_refused = scheduled.ok() ? (*sibling)->Fetch((*scheduled)[0]).AwaitFor(absl::Seconds(30)).status()
                                             : scheduled.status();
  EXPECT_NE(call_refused.message().find("refuses tenant spinner"), std::string::npos) << call_refused;
  auto sibling_lost = (*sibling)->LostSlices();
  EXPECT_EQ(sibling_lost.status().code(), absl::StatusCode::kFailedPrecondition) << sibling_lost.status();
  EXPECT_NE(sibling_lost.status().message().find("refuses tenant spinner"), std::string::npos) << sibling_lost.status();
  // A client of the tenant connected now is refused; a client of the other tenant runs a job.
  auto expect_a_new_spinner_refused = [&] {
    auto anew = Client::Connect(*address, {.token = spinner_token});
    absl::Status refused = anew.ok() ? (*anew)->CreateSlice({.mesh_shape = {2}}).status() : anew.status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("refuses tenant spinner"), std::string::npos) << refused;
  };
  auto expect_the_other_tenant_served = [&] {
    auto next = Client::Connect(*address, {.token = other_token});
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_NO_FATAL_FAILURE(ExpectAJobOnTwoDevicesRuns(**next));
  };
  expect_a_new_spinner_refused();
  auto status = RunCommand({PATHWAYS_BINARY, "status", "--controller", *address, "--token", other_token},
                           absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->find("left:"), std::string::npos) << *status;  // no host left
  EXPECT_NE(status->find("tenant refused: spinner: its client "), std::string::npos) << *status;

  // The workers refuse the tenant too, once their heartbeats hear of it: a compile sent straight
  // to a worker.
  ControllerClient as_other(*address, other_token);
  auto cluster = as_other.GetStatus();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::string a_worker;
  for (const rpc::HostStatus& h : cluster->hosts()) {
    EXPECT_TRUE(h.alive()) << h.address();
    a_worker = h.address();
  }
  ASSERT_FALSE(a_worker.empty());
  absl::Status at_worker;
  for (int i = 0; i < 300; ++i) {  // until its next heartbeat, a second or so
    auto compiled = WorkerClientCache::Global().Get(a_worker, spinner_token)->Compile(rpc::CompileRequest());
    at_worker = compiled.AwaitFor(absl::Seconds(10)).status();
    if (at_worker.code() == absl::StatusCode::kFailedPrecondition) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(at_worker.code(), absl::StatusCode::kFailedPrecondition) << at_worker;
  EXPECT_NE(at_worker.message().find("refuses tenant spinner"), std::string::npos) << at_worker;

  // Another tenant is served.
  ASSERT_NO_FATAL_FAILURE(expect_the_other_tenant_served());
  sibling->reset();
  client->reset();

  // A controller restarted within the hour refuses the tenant still: the worker names the
  // refusal as it registers again (before, the restart forgave the tenant).
  controller.Stop(SIGKILL);
  auto restarted = StartController(controller, with_guard({PATHWAYS_BINARY, "controller", "--listen", *address,
                                                           "--heartbeat-timeout-ms", "5000", "--client-timeout-ms",
                                                           "1000"}));
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  std::string after;
  for (int i = 0; i < 300 && after.find("tenant refused: spinner") == std::string::npos; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(100));  // until the worker's next heartbeat, about a second
    after = RunCommand({PATHWAYS_BINARY, "status", "--controller", *address, "--token", other_token},
                       absl::Seconds(30))
                .value_or("");
  }
  EXPECT_NE(after.find("tenant refused: spinner: its client "), std::string::npos) << after;
  expect_a_new_spinner_refused();
  ASSERT_NO_FATAL_FAILURE(expect_the_other_tenant_served());
  EXPECT_EQ(spinning.Stop(SIGTERM), 0);
  EXPECT_EQ(other.Stop(SIGTERM), 0);
  EXPECT_EQ(controller.Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace pathways
