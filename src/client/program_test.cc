#include "client/program.h"

#include "cluster/local_cluster.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

// Two hosts of 512 devices each: enough for slices of 1, 8 and 1024 devices. Devices are threads
// with a budget, so an idle one costs little.
class ProgramTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = LocalCluster::Start({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 512,
                                    .device_memory_bytes = 1 << 20})
                   ->release();
  }
  static void TearDownTestSuite() { delete cluster_; }
  void SetUp() override { client_ = *cluster_->Connect(); }

  CompiledFunction Elementwise(const std::string& kernel, int64_t n, PartitionSpec in, PartitionSpec out) {
    return *client_->Compile(FunctionSpec::Builtin(kernel, {{DType::kF32, {n}}}, {{DType::kF32, {n}}}, {in}, {out}));
  }

  // A -> B chain over a slice of `shards` devices.
  Program Chain(const VirtualSlice& slice, int64_t n) {
    ProgramBuilder b("chain");
    TracedValue x = b.Arg({DType::kF32, {n}});
    auto y = *b.Call(Elementwise("add_one", n, {"x"}, {"x"}), slice, {x});
    auto z = *b.Call(Elementwise("negate", n, {"x"}, {"x"}), slice, {y[0]});
    return *b.Build({z[0]});
  }

  static LocalCluster* cluster_;
  std::unique_ptr<Client> client_;
};
LocalCluster* ProgramTest::cluster_ = nullptr;

TEST_F(ProgramTest, GraphOfAChainIsTheSameAtOneEightAnd1024Shards) {
  std::vector<std::string> texts;
  for (int64_t shards : {1, 8, 1024}) {
    VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {shards}});
    Program p = Chain(slice, 2048);
    EXPECT_EQ(p.num_graph_nodes(), 4) << shards;  // Arg -> add_one -> negate -> Result
    EXPECT_EQ(p.num_graph_edges(), 3) << shards;
    texts.push_back(p.ToString());
  }
  EXPECT_NE(texts[2].find("%1 = negate(%0) on slice"), std::string::npos) << texts[2];
  EXPECT_NE(texts[2].find("{x=1024}"), std::string::npos) << texts[2];
}

TEST_F(ProgramTest, PerRunClientWorkDoesNotGrowWithShards) {
  struct PerRun {
    int64_t ops, bytes, hosts;
  };
  std::vector<PerRun> per_run;
  for (int64_t shards : {8, 1024}) {
    VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {shards}});
    Program p = Chain(slice, 2048);
    ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {2048}), slice, {"x"});
    // The first run lowers and registers. Its result stays alive until the measured run went: a
    // free of it would be held and carried by that run (or, after a pause, go as an op and make the
    // run name its hosts again), and either depends on timing.
    std::vector<ShardedArray> first = *client_->Run(p, {x});
    ASSERT_TRUE(client_->Fetch(first[0]).Await().ok());
    ClientStats before = client_->stats();
    std::vector<ShardedArray> out = *client_->Run(p, {x});
    ClientStats after = client_->stats();
    first.clear();
    EXPECT_EQ(after.lowerings, before.lowerings);  // cached
    EXPECT_EQ(after.frees_carried, before.frees_carried);
    EXPECT_EQ(after.runs_naming_hosts, before.runs_naming_hosts);
    per_run.push_back({after.run_ops_sent - before.run_ops_sent, after.run_op_bytes_sent - before.run_op_bytes_sent,
                       static_cast<int64_t>(slice.host_addresses().size())});
    auto result = client_->Fetch(out[0]).Await();
    ASSERT_TRUE(result.ok()) << result.status();
    for (int64_t i = 0; i < 2048; ++i) ASSERT_EQ(result->data<float>()[i], -1.0f);
  }
  // One message per run to the island's scheduler, naming each host once (its address and the
  // run's sequence number and session there, under 40 bytes); nothing in it grows with shards.
  // Ids may differ by a varint byte or two.
  for (const PerRun& r : per_run) EXPECT_EQ(r.ops, 1);
  const int64_t host_bytes = std::abs(per_run[1].hosts - per_run[0].hosts) * 40;
  EXPECT_LE(std::abs(per_run[1].bytes - per_run[0].bytes), host_bytes + 4)
      << per_run[0].bytes << " bytes for " << per_run[0].hosts << " hosts vs " << per_run[1].bytes << " for "
      << per_run[1].hosts;
}

TEST_F(ProgramTest, MultiSliceProgramReshardsAndMatchesInBothDispatchModes) {
  VirtualSlice a = *client_->CreateSlice({.mesh_shape = {2, 4}});
  VirtualSlice b = *client_->CreateSlice({.mesh_shape = {4}});
  const TensorSpec m{DType::kF32, {8, 8}};
  auto add_one = *client_->Compile(FunctionSpec::Builtin("add_one", {m}, {m}, {{"x", "y"}}, {{"x", "y"}}));
  auto matmul = *client_->Compile(FunctionSpec::Builtin("matmul", {m, m}, {m}, {{"x", ""}, {}}, {{"x", ""}}));
  auto relu = *client_->Compile(FunctionSpec::Script("relu2", "def relu2(x):\n    return torch.relu(x) * 2.0\n",
                                                     {m}, {m}, {{}}, {{}}));
  ProgramBuilder builder("three_stage");
  TracedValue x = builder.Arg(m);
  auto h = *builder.Call(add_one, a, {x});
  auto g = *builder.Call(matmul, b, {h[0], h[0]});  // a's (x,y) layout to b's rows and replicas
  auto y = *builder.Call(relu, a, {g[0]});          // back to a, replicated
  Program program = *builder.Build({y[0], h[0]});

  HostArray host = *HostArray::Create(DType::kF32, {8, 8});
  for (int i = 0; i < 64; ++i) host.mutable_data<float>()[i] = static_cast<float>(i % 5) - 2.0f;
  std::vector<float> expected(64);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      float acc = 0;
      for (int t = 0; t < 8; ++t) acc += (host.data<float>()[i * 8 + t] + 1) * (host.data<float>()[t * 8 + j] + 1);
      expected[i * 8 + j] = std::max(acc, 0.0f) * 2.0f;
    }
  }
  ShardedArray input = *client_->Put(host, b, {"x", ""});
  for (auto dispatch : {RunOptions::Dispatch::kParallel, RunOptions::Dispatch::kSequential}) {
    auto out = client_->Run(program, {input}, {.dispatch = dispatch});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 2u);
    auto result = client_->Fetch((*out)[0]).Await();
    ASSERT_TRUE(result.ok()) << result.status();
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(result->data<float>()[i], expected[i], 1e-3) << i;
    auto intermediate = client_->Fetch((*out)[1]).Await();
    ASSERT_TRUE(intermediate.ok()) << intermediate.status();
    EXPECT_EQ(intermediate->data<float>()[5], host.data<float>()[5] + 1);
  }
}

TEST_F(ProgramTest, DataDependentNodeStillComputesTheSameAndChainsAcrossRuns) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {4}});
  FunctionSpec dd = FunctionSpec::Builtin("add_one", {{DType::kF32, {4}}}, {{DType::kF32, {4}}}, {{"x"}}, {{"x"}});
  dd.data_dependent_shapes = true;
  auto first = *client_->Compile(dd);
  auto second = Elementwise("add_one", 4, {"x"}, {"x"});
  ProgramBuilder builder("dd");
  TracedValue x = builder.Arg({DType::kF32, {4}});
  auto y = *builder.Call(first, slice, {x});
  auto z = *builder.Call(second, slice, {y[0]});
  Program program = *builder.Build({z[0]});
  EXPECT_NE(program.ToString().find("[data-dependent]"), std::string::npos);
  ShardedArray v = *client_->Put(*HostArray::Create(DType::kF32, {4}), slice, {"x"});
  for (auto dispatch : {RunOptions::Dispatch::kParallel, RunOptions::Dispatch::kSequential}) {
    v = (*client_->Run(program, {v}, {.dispatch = dispatch}))[0];  // the next run consumes it
  }
  auto result = client_->Fetch(v).Await();
  ASSERT_TRUE(result.ok()) << result.status();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(result->data<float>()[i], 4.0f);
}

TEST_F(ProgramTest, TracingErrorsAreClear) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {2}});
  auto fn = Elementwise("add_one", 4, {"x"}, {"x"});
  ProgramBuilder b("bad");
  TracedValue wrong = b.Arg({DType::kF32, {3}});
  auto r = b.Call(fn, slice, {wrong});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'add_one' input 0 must be f32[4], got f32[3]"), std::string::npos);
  ProgramBuilder other("other");
  TracedValue foreign = other.Arg({DType::kF32, {4}});
  EXPECT_FALSE(b.Call(fn, slice, {foreign}).ok());
  EXPECT_FALSE(b.Build({}).ok());  // no calls
  TracedValue ok = b.Arg({DType::kF32, {4}});
  auto y = *b.Call(fn, slice, {ok});
  Program p = *b.Build({y[0]});
  ShardedArray bad_arg = *client_->Put(*HostArray::Create(DType::kF32, {4}), slice, {"x"});
  auto run = client_->Run(p, {bad_arg});  // the program has two arguments
  EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(run.status().message().find("takes 2 arguments"), std::string::npos) << run.status();
}

TEST_F(ProgramTest, HostsDropIntermediatesAndKeepResults) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {4}});
  ProgramBuilder b("long_chain");
  TracedValue v = b.Arg({DType::kF32, {8}});
  auto inc = Elementwise("add_one", 8, {"x"}, {"x"});
  for (int i = 0; i < 10; ++i) v = (*b.Call(inc, slice, {v}))[0];
  Program p = *b.Build({v});
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice, {"x"});
  ASSERT_TRUE(client_->Ready(x).Await().ok());
  auto buffers = [&] {
    size_t n = 0;
    for (int w = 0; w < cluster_->num_workers(); ++w) n += cluster_->worker(w).runtime().store().num_buffers();
    return n;
  };
  const size_t before = buffers();
  const int64_t ops_before = client_->stats().ops_sent;
  std::vector<ShardedArray> out = *client_->Run(p, {x});
  ASSERT_TRUE(client_->Ready(out[0]).Await().ok());
  EXPECT_EQ(buffers() - before, 4u);  // the result's four shards; none of the nine intermediates
  // Registration and one run op per host; no per-intermediate messages.
  EXPECT_LE(client_->stats().ops_sent - ops_before, 2 * static_cast<int64_t>(slice.host_addresses().size()))
      << "run ops " << client_->stats().run_ops_sent << " hosts " << slice.host_addresses().size();
  auto result = client_->Fetch(out[0]).Await();
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->data<float>()[7], 10.0f);
}

TEST_F(ProgramTest, LoweringIsCachedPerArgumentPlacement) {
  VirtualSlice slice = *client_->CreateSlice({.mesh_shape = {4}});
  Program p = Chain(slice, 8);
  ShardedArray split = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice, {"x"});
  ShardedArray replicated = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice, {});
  const int64_t before = client_->stats().lowerings;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client_->Run(p, {split}).ok());
  EXPECT_EQ(client_->stats().lowerings, before + 1);
  auto out = *client_->Run(p, {replicated});
  EXPECT_EQ(client_->stats().lowerings, before + 2);
  ASSERT_TRUE(client_->Fetch(out[0]).Await().ok());
  auto text = client_->DescribeLowering(p, {split});
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("shards 0..3"), std::string::npos) << *text;
}

}  // namespace
}  // namespace pathways
