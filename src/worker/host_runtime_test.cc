#include "worker/host_runtime.h"

#include <cstring>
#include <memory>
#include <vector>

#include "core/executor.h"
#include "core/status_macros.h"
#include "dataflow/engine.h"
#include "dataflow/graph.h"
#include "gtest/gtest.h"
#include "transport/rpc_util.h"
#include "worker/host_ops_testing.h"

namespace pathways {
namespace {

using testing::PutOp;
using testing::RunOp;

rpc::Op Skip(int64_t seq) {
  rpc::Op op;
  op.mutable_skip();
  op.set_seq(seq);
  op.set_session(1);
  return op;
}

class HostRuntimeTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::vector<float>> FetchAfter(int64_t array_id, int64_t seq) {
    return testing::FetchShard(host_, array_id, seq);
  }

  // Puts [1, 2] as op 1 and [3, 4] as op 3 of client "c", with `between` after the first, and
  // expects the second put's array read back once op 3 is applied.
  void ExpectTheSecondPutReadsBack(std::vector<rpc::Op> between) {
    rpc::EnqueueRequest request;
    request.set_client_id("c");
    *request.add_ops() = PutOp(1, 1, 0, {1, 2});
    for (rpc::Op& op : between) *request.add_ops() = std::move(op);
    *request.add_ops() = PutOp(3, 2, 0, {3, 4});
    ASSERT_TRUE(host_.Enqueue(request).ok());
    auto values = FetchAfter(2, 3);
    ASSERT_TRUE(values.ok()) << values.status();
    EXPECT_EQ(*values, (std::vector<float>{3, 4}));
  }

  HostRuntime host_{{.num_devices = 1, .device_memory_bytes = 64 << 20, .name = "h"}};
};

// A client fills the number it reserved for a run the scheduler refused with a skip; the host
// takes it as a no-op, not as a malformed op.
TEST_F(HostRuntimeTest, ASkipKeepsItsPlaceInTheSequenceAndIsNotAnError) {
  ExpectTheSecondPutReadsBack({Skip(2)});
}

// A malformed op from the scheduler (neither a run nor a retirement) is refused, but it keeps its
// client's sequence (as a skip) and does not hold back the valid runs of its batch.
TEST_F(HostRuntimeTest, AMalformedScheduledOpKeepsItsPlaceAndTheRestOfItsBatchApplies) {
  rpc::ScheduledOp malformed;
  malformed.set_client_id("c");
  malformed.set_order(1);
  malformed.mutable_op()->set_seq(2);
  malformed.mutable_op()->set_session(1);
  malformed.mutable_op()->mutable_put();  // a put does not come through the scheduler
  rpc::ScheduledOp nobodys;  // no client: nothing to keep
  nobodys.set_order(2);
  absl::Status refused = host_.ApplyScheduled({malformed, nobodys});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  ExpectTheSecondPutReadsBack({});  // op 3 comes after the malformed op's number
}

// A put whose bytes were staged (over a data stream) takes the staged buffer when its op is
// applied in the client's order; one whose bytes never came fails its array with the reason,
// and a collected client's staged bytes are freed.
TEST_F(HostRuntimeTest, AStagedPutTakesItsBytesInOrderAndAMissingOneSaysSo) {
  rpc::StageRequest stage;
  stage.set_client_id("c");
  stage.mutable_dest()->set_array_id(1);
  *stage.mutable_spec() = ToProto(TensorSpec{DType::kF32, {2}});
  auto landed = host_.LandStaged(stage);
  ASSERT_TRUE(landed.ok()) << landed.status();
  const float values[2] = {7, 8};
  std::memcpy((*landed)->data(), values, sizeof(values));
  ASSERT_TRUE(host_.KeepStaged(stage, *landed).ok());
  landed->reset();
  rpc::EnqueueRequest request;
  request.set_client_id("c");
  for (int64_t id : {1, 2}) {
    rpc::Op op = PutOp(id, id, 0, {});
    *op.mutable_put()->mutable_spec() = ToProto(TensorSpec{DType::kF32, {2}});
    op.mutable_put()->set_staged(true);
    *request.add_ops() = op;
  }
  ASSERT_TRUE(host_.Enqueue(request).ok());
  auto got = FetchAfter(1, 2);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, (std::vector<float>{7, 8}));
  auto missing = FetchAfter(2, 2);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDataLoss) << missing.status();
  EXPECT_NE(missing.status().message().find("never staged"), std::string::npos) << missing.status();
  // Bad landings are refused; staged bytes of a client that is collected are freed.
  rpc::StageRequest bad = stage;
  bad.set_local_device(3);
  EXPECT_EQ(host_.LandStaged(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = stage;
  *bad.mutable_spec() = ToProto(TensorSpec{DType::kF32, {int64_t{1} << 40}});
  EXPECT_FALSE(host_.LandStaged(bad).ok());  // larger than the device, or than any array may be
  const int64_t before = host_.device(0).stats().memory_used;
  stage.mutable_dest()->set_array_id(9);
  ASSERT_TRUE(host_.KeepStaged(stage, *host_.LandStaged(stage)).ok());
  EXPECT_EQ(host_.device(0).stats().memory_used, before + 8);
  EXPECT_TRUE(host_.CollectClient("c"));
  EXPECT_TRUE(host_.device(0).WaitForMemoryUsedAtMost(before, absl::Seconds(30)));
  EXPECT_FALSE(host_.LandStaged(stage).ok());  // a collected client stages nothing more
}

// A function is kept for the clients it was compiled for, counted in the host's counters, and
// goes when the last of them is collected; a collected client compiles nothing more.
TEST_F(HostRuntimeTest, CompiledFunctionsAreKeptForTheirClientsAndGoWithThem) {
  rpc::FunctionBodyProto body;
  body.set_kind(static_cast<int>(FunctionBody::Kind::kTorchScript));
  body.set_name("f");
  body.set_source("def f(x):\n    return x * 2.0 + 1.0\n");
  auto counters = [this] {
    rpc::HostCounters c;
    host_.DescribeCounters(&c);
    return c;
  };
  ASSERT_TRUE(host_.Compile(body, {"c"}).ok());
  ASSERT_TRUE(host_.Compile(body, {"d", "tenant"}).ok());
  EXPECT_EQ(host_.HeldClients(), (std::vector<std::string>{"c", "d"}));
  EXPECT_EQ(counters().compiled_functions(), 1);
  const int64_t kept = counters().compiled_bytes();
  EXPECT_GT(kept, 0);
  EXPECT_TRUE(host_.CollectClient("c"));
  EXPECT_EQ(counters().compiled_functions(), 1);
  auto refused = host_.Compile(body, {"c"});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("went away"), std::string::npos) << refused.status();
  EXPECT_TRUE(host_.CollectClient("d"));
  EXPECT_EQ(counters().compiled_functions(), 0);
  EXPECT_EQ(counters().compiled_bytes(), 0);
  EXPECT_TRUE(host_.HeldClients().empty());
}

TEST_F(HostRuntimeTest, AMalformedOpIsReportedAndLaterOpsStillApply) {
  rpc::EnqueueRequest request;
  request.set_client_id("c");
  *request.add_ops() = PutOp(1, 1, /*device=*/7, {1, 2});
  *request.add_ops() = PutOp(2, 2, 0, {5, 6});
  absl::Status status = host_.Enqueue(request);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("device 7 does not exist"), std::string::npos) << status;
  auto values = FetchAfter(2, 2);
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<float>{5, 6}));
  EXPECT_FALSE(FetchAfter(1, 2).ok());  // the malformed put placed nothing
}

// Errors of ops applied on a host reach whoever reads what the op was to make, with the reason.
TEST_F(HostRuntimeTest, ARunThatCannotStartFailsItsOutputsWithTheReason) {
  rpc::EnqueueRequest request;
  request.set_client_id("c");
  *request.add_ops() = RunOp(1, /*program=*/7, /*base=*/100, /*outputs=*/3);
  ASSERT_TRUE(host_.Enqueue(request).ok());
  for (int64_t id : {100, 102}) {
    auto got = FetchAfter(id, 1);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
    EXPECT_NE(got.status().message().find("program 7 is not registered"), std::string::npos) << got.status();
  }
  EXPECT_NE(FetchAfter(103, 1).status().message().find("no shard"), std::string::npos);  // not the run's
}

TEST_F(HostRuntimeTest, ARunOfAProgramThatFailedToRegisterSaysWhy) {
  // This host has no dataflow service, so it cannot take programs.
  rpc::EnqueueRequest request;
  request.set_client_id("c");
  rpc::Op* reg = request.add_ops();
  reg->set_seq(1);
  reg->set_session(1);
  reg->mutable_register_program()->mutable_program()->set_program_id(7);
  *request.add_ops() = RunOp(2, /*program=*/7, /*base=*/100, /*outputs=*/1);
  ASSERT_TRUE(host_.Enqueue(request).ok());
  auto got = FetchAfter(100, 2);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_NE(got.status().message().find("program 7 failed to register"), std::string::npos) << got.status();
  EXPECT_NE(got.status().message().find("no dataflow service"), std::string::npos) << got.status();
}

// Forwards what it is given to the next node's shard 0.
class Forward : public dataflow::Operator {
 public:
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override { ctx.Send(0, 0, payload); }
  void OnEpochDone(dataflow::ShardContext&) override {}
};

// A block that reaches the receiving end of a node's exchange and does not parse cannot say whose
// it was: the blocks its epoch still lacks fail when the epoch ends, with that as the reason. The
// reason belongs to its epoch alone.
TEST_F(HostRuntimeTest, ABlockThatDoesNotParseFailsWhatItsEpochLacksWithTheReason) {
  constexpr int kProgramNode = 5;
  auto graph = std::make_shared<dataflow::GraphDef>("exchange");
  ASSERT_TRUE(graph->AddNode("senders", {"h"}).ok());
  ASSERT_TRUE(graph->AddNode("receivers", {"h"}).ok());
  ASSERT_TRUE(graph->AddEdge(0, 1, dataflow::EdgeKind::kOneToOne).ok());
  dataflow::LocalTransport transport;
  ThreadPool pool("exchange", 1);
  auto engine = std::make_shared<dataflow::Engine>(
      "h", graph,
      [&](int node, int) -> std::unique_ptr<dataflow::Operator> {
        if (node == 0) return std::make_unique<Forward>();
        return host_.TEST_MakeBlockReceiver("c", kProgramNode);
      },
      transport, pool);
  transport.Register(engine.get());

  ObjectStore& store = host_.TEST_store();
  Future<BufferPtr> garbled = store.ExpectTransfer("c", {.epoch = Epoch(1), .node = kProgramNode, .input = 0, .dst_shard = 0, .src_shard = 0});
  Future<BufferPtr> missing = store.ExpectTransfer("c", {.epoch = Epoch(2), .node = kProgramNode, .input = 0, .dst_shard = 0, .src_shard = 0});
  ASSERT_TRUE(engine->InjectAll(0, 0, /*epoch=*/1, {"not a transfer request"}).ok());
  ASSERT_TRUE(engine->InjectAll(0, 0, /*epoch=*/2, {}).ok());

  auto first = garbled.AwaitFor(absl::Seconds(30));
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.status().message().find("epoch 1"), std::string::npos) << first.status();
  EXPECT_NE(first.status().message().find("a block of 22 bytes that does not parse reached h"), std::string::npos)
      << first.status();
  auto second = missing.AwaitFor(absl::Seconds(30));
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("never reached h"), std::string::npos) << second.status();
  EXPECT_EQ(second.status().message().find("does not parse"), std::string::npos) << second.status();
  engine->Shutdown();
  pool.Shutdown();
}

}  // namespace
}  // namespace pathways
