// Setting up a run (outputs, inputs, blocks, dataflow) and executing its shards, on two hosts of
// one process: blocks between them travel as buffers, their dataflow graph's batches through the
// in-process directory.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "dataflow/dataflow_service.h"
#include "gtest/gtest.h"
#include "worker/host_ops_testing.h"
#include "worker/host_runtime.h"

namespace pathways {
namespace {

using testing::FetchShard;
using testing::PutOp;
using testing::RunOp;
using testing::TwoHostProgram;

constexpr int64_t kArg = 1;
constexpr int64_t kOutputs = 100;  // node n's output is array kOutputs + n

class HostRunTest : public ::testing::Test {
 protected:
  struct Host {
    explicit Host(const std::string& name, int64_t device_memory)
        : runtime({.num_devices = 2,
                   .device_memory_bytes = device_memory,
                   .name = name,
                   .dataflow_service = &dataflow,
                   .memory_wait = absl::Milliseconds(200)}) {
      dataflow.ServeInProcess(name);
    }
    dataflow::DataflowService dataflow;  // before the runtime, which registers graphs with it
    HostRuntime runtime;
  };

  // Compiles `first` and add_one on both hosts, registers the program on both, puts the argument
  // [1 .. 8] on A and runs the program once. B first, unless `a_first`: then B gets its ops only
  // once B's dataflow service has dropped a batch from A (A's blocks went before B was ready).
  void RegisterAndRun(const rpc::FunctionBodyProto& first, bool a_first = false) {
    std::string first_key, add_one_key;
    for (Host* host : {a_.get(), b_.get()}) {
      auto key = host->runtime.Compile(first);
      ASSERT_TRUE(key.ok()) << key.status();
      first_key = *key;
      auto add_one = host->runtime.Compile(Builtin("add_one"));
      ASSERT_TRUE(add_one.ok()) << add_one.status();
      add_one_key = *add_one;
    }
    rpc::EnqueueRequest on_a, on_b;
    on_a.set_client_id(testing::kClient);
    on_b.set_client_id(testing::kClient);
    *on_a.add_ops() = PutOp(1, kArg, 0, {1, 2, 3, 4}, /*shard=*/0);
    *on_a.add_ops() = PutOp(2, kArg, 1, {5, 6, 7, 8}, /*shard=*/1);
    for (auto [request, seq] : {std::pair{&on_a, 3}, std::pair{&on_b, 1}}) {
      rpc::Op* reg = request->add_ops();
      reg->set_seq(seq);
      reg->set_session(1);
      *reg->mutable_register_program()->mutable_program() = TwoHostProgram(first_key, add_one_key);
      rpc::Op run = RunOp(seq + 1, testing::kTwoHostProgram, kOutputs, 3);
      run.mutable_run()->set_epoch(1);
      run.mutable_run()->add_arg_array_ids(kArg);
      run.mutable_run()->set_last_node(2);
      *request->add_ops() = std::move(run);
    }
    if (a_first) {
      ASSERT_TRUE(a_->runtime.Enqueue(on_a).ok());
      ASSERT_TRUE(b_->dataflow.WaitForDrops(1, absl::Seconds(30))) << "A sent B nothing in 30 s";
      ASSERT_TRUE(b_->runtime.Enqueue(on_b).ok());
      return;
    }
    // B first: its inputs wait for blocks that A sends once its own set-up is done.
    ASSERT_TRUE(b_->runtime.Enqueue(on_b).ok());
    ASSERT_TRUE(a_->runtime.Enqueue(on_a).ok());
  }

  static rpc::FunctionBodyProto Builtin(const std::string& name) {
    rpc::FunctionBodyProto body;
    body.set_kind(static_cast<int>(FunctionBody::Kind::kBuiltin));
    body.set_name(name);
    return body;
  }

  std::unique_ptr<Host> a_ = std::make_unique<Host>("A", 64 << 20);
  std::unique_ptr<Host> b_ = std::make_unique<Host>("B", 64 << 20);
};

TEST_F(HostRunTest, ARunOverTwoHostsExchangesItsBlocksAndFillsEveryOutputShard) {
  RegisterAndRun(Builtin("add_one"));
  if (HasFatalFailure()) return;
  // Node 0's output is an intermediate: dropped once its consumers are set up.
  for (int shard : {0, 1}) {
    auto split = FetchShard(b_->runtime, kOutputs + 1, 2, shard);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(*split, shard == 0 ? (std::vector<float>{3, 4, 5, 6}) : (std::vector<float>{7, 8, 9, 10}));
    auto whole = FetchShard(b_->runtime, kOutputs + 2, 2, shard);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(*whole, (std::vector<float>{3, 4, 5, 6, 7, 8, 9, 10}));
  }
  EXPECT_FALSE(FetchShard(a_->runtime, kOutputs, 4).ok());  // the intermediate left A's store
  // Outputs are charged to their devices; they go with the client.
  EXPECT_GT(b_->runtime.device(0).stats().memory_used, 0);
  EXPECT_TRUE(b_->runtime.CollectClient(testing::kClient));
  EXPECT_TRUE(b_->runtime.device(0).WaitForMemoryUsedAtMost(0, absl::Seconds(30)));
}

// A shard that fails on its device fails what it was to make, and the consumers of its blocks on
// the other host fail with its reason and the host it came from.
TEST_F(HostRunTest, AShardThatFailsOnItsDeviceFailsItsConsumersOnAnotherHostWithItsReason) {
  rpc::FunctionBodyProto raises;  // a shard of A holds 4 elements: the add fails on the device
  raises.set_kind(static_cast<int>(FunctionBody::Kind::kTorchScript));
  raises.set_name("f");
  raises.set_source("def f(x):\n    return x + torch.ones(5)\n");
  RegisterAndRun(raises);
  if (HasFatalFailure()) return;
  for (int64_t array : {kOutputs + 1, kOutputs + 2}) {
    auto got = FetchShard(b_->runtime, array, 2);
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("must match the size of tensor b (5)"), std::string::npos) << got.status();
    EXPECT_NE(got.status().message().find("from host A"), std::string::npos) << got.status();
  }
}

// A shard whose output does not fit its device's memory, once the memory wait is over, fails with
// ResourceExhausted, which reaches the consumers on the other host.
TEST_F(HostRunTest, AShardOutOfDeviceMemoryFailsItsConsumersWithResourceExhausted) {
  rpc::FunctionBodyProto widen;
  widen.set_kind(static_cast<int>(FunctionBody::Kind::kTorchScript));
  widen.set_name("f");
  widen.set_source("def f(x):\n    return x.repeat(1000000)[:4]\n");
  a_.reset();  // replaced by a host whose devices hold little more than the argument
  a_ = std::make_unique<Host>("A", 1 << 20);
  RegisterAndRun(widen);
  if (HasFatalFailure()) return;
  auto got = FetchShard(b_->runtime, kOutputs + 1, 2);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_NE(got.status().message().find("from host A"), std::string::npos) << got.status();
}

// A shard of A fails and its failure travels to B in the dataflow graph, but B, which has not
// set the program up yet, drops the batch (past its per-peer bound). B's consumers fail at set-up
// with the reason, instead of waiting for a block that will never come. A's two shards may send
// their failures in one batch or two, and the second may come once B is set up: a consumer whose
// batch came fails with A's own reason, but none waits, and at least one hears of the loss.
TEST_F(HostRunTest, ARunWhoseBatchesWereDroppedBeforeItsProgramCameFailsWithWhy) {
  b_->dataflow.SetHoldLimits(/*bytes=*/1 << 20, /*bytes_per_graph=*/1 << 20, /*bytes_per_peer=*/1);
  rpc::FunctionBodyProto raises;
  raises.set_kind(static_cast<int>(FunctionBody::Kind::kTorchScript));
  raises.set_name("f");
  raises.set_source("def f(x):\n    return x + torch.ones(5)\n");
  RegisterAndRun(raises, /*a_first=*/true);
  if (HasFatalFailure()) return;
  int lost = 0;
  for (int64_t array : {kOutputs + 1, kOutputs + 2}) {
    for (int shard : {0, 1}) {
      auto got = FetchShard(b_->runtime, array, 2, shard);
      ASSERT_FALSE(got.ok());
      const absl::string_view why = got.status().message();
      if (got.status().code() == absl::StatusCode::kUnavailable) {
        ++lost;
        EXPECT_NE(why.find("dataflow batches for it were lost"), std::string::npos) << got.status();
        EXPECT_NE(why.find("from A came before the graph was set up"), std::string::npos) << got.status();
      } else {
        EXPECT_NE(why.find("must match the size of tensor b (5)"), std::string::npos) << got.status();
        EXPECT_NE(why.find("from host A"), std::string::npos) << got.status();
      }
    }
  }
  EXPECT_GT(lost, 0);
}

// A batch for the run's graph from a host that is not one of the graph's cannot be the run's:
// dropping it fails nothing.
TEST_F(HostRunTest, ADroppedBatchFromAHostOutsideTheProgramFailsNothing) {
  b_->dataflow.SetHoldLimits(/*bytes=*/1 << 20, /*bytes_per_graph=*/1 << 20, /*bytes_per_peer=*/1000);
  dataflow::Envelope e;
  e.epoch = 1;  // the run's
  e.payload.assign(2000, 'x');
  b_->dataflow.Receive("a flooding peer", absl::StrCat(testing::kClient, "/", testing::kTwoHostProgram), {e});
  ASSERT_EQ(b_->dataflow.batches_dropped(), 1);
  RegisterAndRun(Builtin("add_one"));
  if (HasFatalFailure()) return;
  auto whole = FetchShard(b_->runtime, kOutputs + 2, 2);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, (std::vector<float>{3, 4, 5, 6, 7, 8, 9, 10}));
}

}  // namespace
}  // namespace pathways
