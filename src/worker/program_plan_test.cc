#include "worker/program_plan.h"

#include "gtest/gtest.h"
#include "worker/host_ops_testing.h"

namespace pathways {
namespace {

// The program of worker/host_ops_testing.h: node 0 on host A, nodes 1 and 2 on host B reading its
// output split and whole.
rpc::ProgramProto TwoHostProgram() { return testing::TwoHostProgram("key", "key"); }

// The plan on `host`; one of no nodes when planning failed (the failure is reported).
ProgramPlan Plan(const std::string& host) {
  auto lowered = LoweredProgram::Create(TwoHostProgram(), host, 2);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  if (!lowered.ok()) return {{}, std::make_shared<dataflow::GraphDef>("")};
  auto plan = PlanProgram(**lowered, host, "client/3");
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return {{}, std::make_shared<dataflow::GraphDef>("")};
  return *std::move(plan);
}

TEST(ProgramPlanTest, ANodeWhoseInputsStayOnItsHostExchangesNothing) {
  const ProgramPlan a = Plan("A"), b = Plan("B");
  ASSERT_EQ(a.nodes.size(), 3u);
  ASSERT_EQ(b.nodes.size(), 3u);
  for (const ProgramPlan* plan : {&a, &b}) {
    const NodePlan& node = plan->nodes[0];
    EXPECT_TRUE(node.sends.empty());
    EXPECT_EQ(node.send_node, -1);
    EXPECT_EQ(node.recv_node, -1);
  }
  // A computes both shards of node 0, each from its own whole shard of the argument.
  const NodePlan& on_a = a.nodes[0];
  ASSERT_EQ(on_a.shards.size(), 2u);
  for (const ShardPlan& shard : on_a.shards) ASSERT_EQ(shard.inputs[0].size(), 1u);
  EXPECT_EQ(on_a.shards[0].inputs[0][0].src_shard, 0);
  EXPECT_EQ(on_a.shards[1].inputs[0][0].src_shard, 1);
  EXPECT_TRUE(b.nodes[0].shards.empty());
  EXPECT_EQ(on_a.out_specs[0].shape, (Shape{4}));  // each local shard holds half
}

// A chain on one slice over two hosts: each host plans only its own shards, each reading its own
// device's block, and no host exchanges anything (what keeps registration at 512 hosts cheap).
TEST(ProgramPlanTest, AChainOverSeveralHostsPlansOnlyLocalShards) {
  rpc::ProgramProto p;
  p.set_program_id(4);
  rpc::SliceProto* slice = p.add_slices();
  slice->set_slice_id(1);
  slice->add_mesh_dims(4);
  slice->add_axis_names("x");
  for (int d = 0; d < 4; ++d) {
    rpc::SliceDevice* device = slice->add_devices();
    device->set_device_id(d);
    device->set_host_address(d < 2 ? "A" : "B");
    device->set_local_index(d % 2);
  }
  rpc::TensorSpecProto spec;
  spec.set_dtype(static_cast<int>(DType::kF32));
  spec.add_shape(8);
  rpc::PartitionSpecProto split;
  split.add_dims("x");
  rpc::ProgramArg* arg = p.add_args();
  *arg->mutable_spec() = spec;
  arg->set_slice_id(1);
  *arg->mutable_sharding() = split;
  for (int n = 0; n < 3; ++n) {
    rpc::ProgramNode* node = p.add_nodes();
    node->set_function_key("key");
    node->set_function_name("f");
    node->set_slice_id(1);
    rpc::ValueRef* v = node->add_inputs();
    v->set_is_arg(n == 0);
    v->set_index(n == 0 ? 0 : n - 1);
    *node->add_input_specs() = spec;
    *node->add_in_shardings() = split;
    *node->add_output_specs() = spec;
    *node->add_out_shardings() = split;
  }
  p.add_results()->set_index(2);
  for (const std::string host : {"A", "B"}) {
    auto lowered = LoweredProgram::Create(p, host, 2);
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    auto plan = PlanProgram(**lowered, host, "client/4");
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->graph->nodes().empty());
    for (const NodePlan& node : plan->nodes) {
      EXPECT_EQ(node.send_node, -1);
      EXPECT_TRUE(node.sends.empty());
      ASSERT_EQ(node.shards.size(), 2u);
      for (const ShardPlan& shard : node.shards) {
        ASSERT_EQ(shard.inputs[0].size(), 1u);
        EXPECT_EQ(shard.inputs[0][0].src_shard, shard.shard);
        EXPECT_EQ(shard.inputs[0][0].src_region.size, (Shape{2}));
      }
      EXPECT_EQ(node.shards[0].shard, host == "A" ? 0 : 2);
    }
  }
}

// Planning takes a slice's shards to be on distinct devices; a program saying otherwise (forged,
// or from a broken client) is refused when it is registered, not planned into a wait that never
// ends.
TEST(ProgramPlanTest, ASliceNamingADeviceTwiceIsRefused) {
  rpc::ProgramProto p = TwoHostProgram();
  p.mutable_slices(1)->mutable_devices(1)->set_device_id(p.slices(1).devices(0).device_id());
  auto lowered = LoweredProgram::Create(p, "B", 2);
  EXPECT_TRUE(absl::IsInvalidArgument(lowered.status())) << lowered.status();
  EXPECT_NE(lowered.status().message().find("twice"), std::string::npos) << lowered.status();
}

TEST(ProgramPlanTest, TheSenderOwesEachBlockTheReceiverAssemblesFrom) {
  const ProgramPlan a = Plan("A"), b = Plan("B");
  ASSERT_EQ(a.nodes.size(), 3u);
  ASSERT_EQ(b.nodes.size(), 3u);
  // Split the same way: shard d of B reads shard d of A, one block each.
  const NodePlan& send = a.nodes[1];
  ASSERT_EQ(send.sends.size(), 2u);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(send.sends[d].dest, "B");
    EXPECT_EQ(send.sends[d].src_shard, d);
    EXPECT_EQ(send.sends[d].dst_shard, d);
  }
  EXPECT_TRUE(send.shards.empty());  // A computes nothing of node 1
  const NodePlan& receive = b.nodes[1];
  EXPECT_TRUE(receive.sends.empty());
  ASSERT_EQ(receive.shards.size(), 2u);
  for (int d = 0; d < 2; ++d) {
    ASSERT_EQ(receive.shards[d].inputs[0].size(), 1u);
    EXPECT_EQ(receive.shards[d].inputs[0][0].src_shard, d);
  }
  // Read whole: every shard of B needs both of A's shards, so A owes four blocks.
  EXPECT_EQ(a.nodes[2].sends.size(), 4u);
  for (const ShardPlan& shard : b.nodes[2].shards) EXPECT_EQ(shard.inputs[0].size(), 2u);
}

TEST(ProgramPlanTest, EveryHostDerivesTheSameGraph) {
  const ProgramPlan a = Plan("A"), b = Plan("B");
  ASSERT_EQ(a.nodes.size(), 3u);
  ASSERT_EQ(b.nodes.size(), 3u);
  EXPECT_EQ(a.graph->name(), "client/3");
  ASSERT_EQ(a.graph->nodes().size(), b.graph->nodes().size());
  EXPECT_EQ(a.graph->nodes().size(), 6u);  // send, arm and receive for nodes 1 and 2
  for (size_t n = 0; n < a.graph->nodes().size(); ++n) {
    EXPECT_EQ(a.graph->nodes()[n].name, b.graph->nodes()[n].name);
    EXPECT_EQ(a.graph->nodes()[n].shard_hosts, b.graph->nodes()[n].shard_hosts);
  }
  ASSERT_EQ(a.graph->edges().size(), b.graph->edges().size());
  EXPECT_EQ(a.graph->edges().size(), 4u);  // per exchange: send -> recv (sparse), arm -> recv
  for (size_t e = 0; e < a.graph->edges().size(); ++e) {
    EXPECT_EQ(a.graph->edges()[e].from, b.graph->edges()[e].from);
    EXPECT_EQ(a.graph->edges()[e].to, b.graph->edges()[e].to);
    EXPECT_EQ(a.graph->edges()[e].kind, b.graph->edges()[e].kind);
  }
  for (int n = 1; n <= 2; ++n) {
    EXPECT_EQ(a.nodes[n].send_node, b.nodes[n].send_node);
    EXPECT_EQ(a.nodes[n].edge, b.nodes[n].edge);
    EXPECT_EQ(a.nodes[n].recv_node, b.nodes[n].recv_node);
    EXPECT_EQ(a.nodes[n].sender_index.at("A"), 0);
    EXPECT_EQ(b.nodes[n].receiver_index.at("B"), 0);
  }
  // The gang of a node is its slice's devices, shared by the nodes on one slice.
  EXPECT_EQ(a.nodes[1].gang, a.nodes[2].gang);
  ASSERT_EQ(a.nodes[1].gang->members.size(), 2u);
  EXPECT_EQ(a.nodes[1].gang->members[0].host, "B");
}


// What a client says about donation is checked like the rest of a program: a donor per output,
// each an input of the node with the output's dtype and shard shape, given to one output only.
TEST(ProgramPlanTest, OutputDonorsAreChecked) {
  rpc::ProgramProto good = TwoHostProgram();
  good.mutable_nodes(0)->add_output_donors(0);
  auto lowered = LoweredProgram::Create(good, "A", 2);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  EXPECT_EQ((*lowered)->args_donated_to(0), std::vector<int>{0});
  EXPECT_EQ((*lowered)->nodes()[0].output_donors, std::vector<int>{0});

  auto refused = [](rpc::ProgramProto p, const std::string& what) {
    auto l = LoweredProgram::Create(p, "A", 2);
    ASSERT_FALSE(l.ok()) << what;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << l.status();
  };
  rpc::ProgramProto out_of_range = TwoHostProgram();
  out_of_range.mutable_nodes(0)->add_output_donors(1);
  refused(out_of_range, "an input the node does not have");
  rpc::ProgramProto negative = TwoHostProgram();
  negative.mutable_nodes(0)->add_output_donors(-7);
  refused(negative, "a negative donor");
  rpc::ProgramProto too_many = TwoHostProgram();
  too_many.mutable_nodes(0)->add_output_donors(0);
  too_many.mutable_nodes(0)->add_output_donors(0);
  refused(too_many, "more donors than outputs");
  rpc::ProgramProto reshaped = TwoHostProgram();
  reshaped.mutable_nodes(2)->mutable_out_shardings(0)->set_dims(0, "x");  // whole input, split output:
  reshaped.mutable_nodes(2)->add_output_donors(0);                        // shards differ
  refused(reshaped, "shards of another shape");
}

}  // namespace
}  // namespace pathways
