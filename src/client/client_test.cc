#include "client/client.h"

#include <iostream>
#include <numeric>
#include <thread>

#include "client/client_test_fixture.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "compute/counter_rng.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST_F(ClientTest, SliceOfEightSpansBothHosts) {
  EXPECT_EQ(slice8_.num_devices(), 8);
  EXPECT_EQ(slice8_.host_addresses().size(), 2u);
}

TEST_F(ClientTest, PutFetchRoundTripsEverySharding) {
  HostArray data = Iota({8, 12});
  for (PartitionSpec spec : {PartitionSpec{"x", "y"}, PartitionSpec{"y", ""}, PartitionSpec{"", "x"},
                             PartitionSpec{}}) {
    auto array = client_->Put(data, slice8_, spec);
    ASSERT_TRUE(array.ok()) << array.status();
    auto back = client_->Fetch(*array).Await();
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(Values(*back), Values(data)) << PartitionSpecToString(spec);
  }
}

TEST_F(ClientTest, ShardedMatmulThenChainedFunction) {
  const int64_t m = 16, k = 8, n = 12;
  HostArray a = Iota({m, k}, 0.5f), b = Iota({k, n}, 0.25f);
  auto fa = client_->Put(a, slice8_, {"x", ""});  // rows over x, replicated over y
  auto fb = client_->Put(b, slice8_, {"", "y"});  // columns over y
  ASSERT_TRUE(fa.ok() && fb.ok());
  auto matmul = client_->Compile(FunctionSpec::Builtin(
      "matmul", {{DType::kF32, {m, k}}, {DType::kF32, {k, n}}}, {{DType::kF32, {m, n}}},
      {{"x", ""}, {"", "y"}}, {{"x", "y"}}));
  ASSERT_TRUE(matmul.ok()) << matmul.status();
  auto relu_plus = client_->Compile(FunctionSpec::Script(
      "relu_plus", "def relu_plus(x):\n    return torch.relu(x) + 1.0\n", {{DType::kF32, {m, n}}},
      {{DType::kF32, {m, n}}}, {{"x", "y"}}, {{"x", "y"}}));
  ASSERT_TRUE(relu_plus.ok()) << relu_plus.status();
  auto c = client_->Call(*matmul, slice8_, {*fa, *fb});
  ASSERT_TRUE(c.ok()) << c.status();
  auto d = client_->Call(*relu_plus, slice8_, {(*c)[0]});  // consumes c before it is computed
  ASSERT_TRUE(d.ok()) << d.status();
  auto result = client_->Fetch((*d)[0]).Await();
  ASSERT_TRUE(result.ok()) << result.status();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0;
      for (int64_t t = 0; t < k; ++t) acc += a.data<float>()[i * k + t] * b.data<float>()[t * n + j];
      EXPECT_NEAR(result->data<float>()[i * n + j], std::max(acc, 0.0f) + 1.0f, 1e-3);
    }
  }
}

TEST_F(ClientTest, InputsMoveBetweenIslandsAndReshard) {
  HostArray data = Iota({8, 4});
  auto on0 = client_->Put(data, island0_, {"x", ""});
  ASSERT_TRUE(on0.ok());
  // Same function on island 1, wanting the array split by columns: every block crosses hosts.
  auto negate = client_->Compile(FunctionSpec::Builtin("negate", {{DType::kF32, {8, 4}}},
                                                       {{DType::kF32, {8, 4}}}, {{"", "x"}}, {{"", "x"}}));
  ASSERT_TRUE(negate.ok());
  auto out = client_->Call(*negate, island1_, {*on0});
  ASSERT_TRUE(out.ok()) << out.status();
  // And back to a replicated layout on island 0.
  auto back = client_->Compile(FunctionSpec::Builtin("negate", {{DType::kF32, {8, 4}}},
                                                     {{DType::kF32, {8, 4}}}, {{}}, {{}}));
  auto twice = client_->Call(*back, island0_, {(*out)[0]});
  ASSERT_TRUE(twice.ok()) << twice.status();
  auto result = client_->Fetch((*twice)[0]).Await();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(Values(*result), Values(data));
}

TEST_F(ClientTest, LongChainOfFutures) {
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {{DType::kF32, {8}}},
                                                     {{DType::kF32, {8}}}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice8_, {"x"});
  for (int i = 0; i < 50; ++i) x = (*client_->Call(inc, slice8_, {x}))[0];
  auto result = client_->Fetch(x).Await();
  ASSERT_TRUE(result.ok()) << result.status();
  for (float v : Values(*result)) EXPECT_EQ(v, 50.0f);
}

TEST_F(ClientTest, BadInputsAreClearErrorsAndTheClusterKeepsServing) {
  auto mm = *client_->Compile(FunctionSpec::Builtin(
      "matmul", {{DType::kF32, {4, 4}}, {DType::kF32, {4, 4}}}, {{DType::kF32, {4, 4}}}));
  auto square = *client_->Put(Iota({4, 4}), island0_);
  auto wrong_shape = *client_->Put(Iota({4, 2}), island0_);
  auto wrong_dtype = *client_->Put(*HostArray::Create(DType::kF64, {4, 4}), island0_);

  auto r = client_->Call(mm, island0_, {square, wrong_shape});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'matmul' input 1 must be f32[4,4], got f32[4,2]"),
            std::string::npos) << r.status();
  r = client_->Call(mm, island0_, {wrong_dtype, square});
  EXPECT_NE(r.status().message().find("got f64[4,4]"), std::string::npos) << r.status();
  r = client_->Call(mm, island0_, {square});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  auto unknown = client_->Compile(FunctionSpec::Builtin("no_such_kernel", {}, {}));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("no_such_kernel"), std::string::npos);

  auto syntax = client_->Compile(FunctionSpec::Script(
      "bad_syntax", "def bad_syntax(x):\n    return x +* 2\n", {{DType::kF32, {4}}}, {{DType::kF32, {4}}}));
  EXPECT_EQ(syntax.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(syntax.status().message().find("'bad_syntax'"), std::string::npos) << syntax.status();
  EXPECT_NE(syntax.status().message().find("line 2"), std::string::npos) << syntax.status();

  auto too_big = client_->CreateSlice({.mesh_shape = {64}});
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(client_->CreateSlice({.mesh_shape = {0}}).ok());

  auto huge = HostArray::Create(DType::kF32, {int64_t{1} << 30, int64_t{1} << 30});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);

  // A shard larger than a device's whole memory (64 MiB here) is refused at Put, not at its first
  // use; split over the four devices the same array fits.
  HostArray wide = *HostArray::Create(DType::kF32, {20 << 20});  // 80 MiB
  auto whole = client_->Put(wide, island0_);
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kResourceExhausted) << whole.status();
  for (const char* part : {"f32[20971520]", "83886080 bytes", "67108864 bytes", "partition spec"}) {
    EXPECT_NE(whole.status().message().find(part), std::string::npos) << part << " in: " << whole.status();
  }
  auto split = client_->Put(wide, island0_, {"x"});
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_TRUE(client_->Ready(*split).Await().ok());

  // A function that fails at run time fails its run, naming itself; the next run works.
  auto boom = *client_->Compile(FunctionSpec::Script(
      "boom", "def boom(x):\n    assert bool(x.sum() < -1000.0), 'kaboom'\n    return x\n",
      {{DType::kF32, {4, 4}}}, {{DType::kF32, {4, 4}}}));
  auto failed = client_->Call(boom, island0_, {square});
  ASSERT_TRUE(failed.ok());
  auto fetched = client_->Fetch((*failed)[0]).Await();
  EXPECT_FALSE(fetched.ok());
  EXPECT_NE(fetched.status().message().find("'boom'"), std::string::npos) << fetched.status();
  EXPECT_NE(fetched.status().message().find("kaboom"), std::string::npos) << fetched.status();
  // Errors propagate to consumers of the failed output.
  auto after = client_->Call(mm, island0_, {(*failed)[0], square});
  ASSERT_TRUE(after.ok());
  EXPECT_FALSE(client_->Fetch((*after)[0]).Await().ok());

  auto good = client_->Call(mm, island0_, {square, square});
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(client_->Fetch((*good)[0]).Await().ok());
}

TEST_F(ClientTest, OutputSignatureMismatchIsReported) {
  // The body returns a sum (a scalar); the signature promises a vector.
  auto lying = *client_->Compile(FunctionSpec::Builtin("sum", {{DType::kF32, {4}}}, {{DType::kF32, {4}}}));
  auto x = *client_->Put(Iota({4}), island0_);
  auto out = *client_->Call(lying, island0_, {x});
  auto r = client_->Fetch(out[0]).Await();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'sum' output 0"), std::string::npos) << r.status();
}

TEST_F(ClientTest, DroppingAnArrayFreesItsShards) {
  Worker& w = cluster_->worker(0);
  auto used = [&] {
    int64_t total = 0;
    for (int i = 0; i < w.runtime().num_devices(); ++i) total += w.runtime().device(i).stats().memory_used;
    return total;
  };
  const int64_t before = used();
  const size_t buffers_before = w.runtime().store().num_buffers();
  std::vector<int64_t> used_before;
  for (int i = 0; i < w.runtime().num_devices(); ++i) used_before.push_back(w.runtime().device(i).stats().memory_used);
  {
    auto big = *client_->Put(*HostArray::Create(DType::kF32, {4, 1024}), island0_, {"x", ""});
    ASSERT_TRUE(client_->Ready(big).Await().ok());
    EXPECT_EQ(used() - before, 4 * 1024 * 4);
  }
  // The free travels in order on the same queue as this later put, so once that is ready the
  // store has dropped the big array; its buffers go when the last in-flight user lets go.
  auto small = *client_->Put(*HostArray::Create(DType::kF32, {4}), island0_, {"x"});
  ASSERT_TRUE(client_->Ready(small).Await().ok());
  EXPECT_EQ(w.runtime().store().num_buffers(), buffers_before + 4);
  for (int i = 0; i < w.runtime().num_devices(); ++i) {
    EXPECT_TRUE(w.runtime().device(i).WaitForMemoryUsedAtMost(used_before[i] + 4, absl::Seconds(30))) << i;
  }
}

// In a pipelined loop `x = f(x)` the array each run leaves behind is freed by the next run, which
// carries its id to the hosts (no free op to each host); one whose hosts the next run does not
// reach (x and y live on different islands) goes as free ops; and what is still held when the
// loop ends goes before the client's next op. Large arrays' frees never wait for a run. Nothing
// leaks and every value is right.
TEST_F(ClientTest, ALoopsDroppedArraysAreFreedByItsNextRuns) {
  const TensorSpec spec{DType::kF32, {4}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  auto buffers = [&] {
    return cluster_->worker(0).runtime().store().num_buffers() + cluster_->worker(1).runtime().store().num_buffers();
  };
  const size_t buffers_before = buffers();
  const int64_t carried_before = client_->stats().frees_carried;
  {
    ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {4}), island0_, {"x"});
    ShardedArray y = *client_->Put(*HostArray::Create(DType::kF32, {4}), island1_, {"x"});
    for (int i = 0; i < 200; ++i) {
      auto out = client_->Call(inc, island0_, {x});
      ASSERT_TRUE(out.ok()) << out.status();
      x = (*out)[0];
      if (i % 3 == 0) y = (*client_->Call(inc, island1_, {y}))[0];
    }
    auto got_x = client_->Fetch(x).Await();
    auto got_y = client_->Fetch(y).Await();
    ASSERT_TRUE(got_x.ok() && got_y.ok()) << got_x.status() << " " << got_y.status();
    for (float f : Values(*got_x)) EXPECT_EQ(f, 200.0f);
    for (float f : Values(*got_y)) EXPECT_EQ(f, 67.0f);
  }
  EXPECT_GT(client_->stats().frees_carried - carried_before, 0);
  // Shards over kMaxCarriedShardBytes are freed by ops at once, never held for a run.
  {
    const TensorSpec big{DType::kF32, {4, 32 << 10}};  // 128 KiB a shard
    auto inc_big = *client_->Compile(FunctionSpec::Builtin("add_one", {big}, {big}, {{"x", ""}}, {{"x", ""}}));
    ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {4, 32 << 10}), island0_, {"x", ""});
    const int64_t carried = client_->stats().frees_carried;
    for (int i = 0; i < 20; ++i) x = (*client_->Call(inc_big, island0_, {x}))[0];
    ASSERT_TRUE(client_->Ready(x).Await().ok());
    EXPECT_EQ(client_->stats().frees_carried, carried);
  }
  // However many small arrays are dropped while runs are on their way, at most 1 MiB of them
  // wait for a run; the rest go as ops at once.
  {
    const TensorSpec mid{DType::kF32, {4, 16 << 10}};  // 64 KiB a shard: the most that is held
    auto inc_mid = *client_->Compile(FunctionSpec::Builtin("add_one", {mid}, {mid}, {{"x", ""}}, {{"x", ""}}));
    std::vector<ShardedArray> many;
    for (int i = 0; i < 40; ++i) many.push_back(*client_->Put(*HostArray::Create(DType::kF32, {4, 16 << 10}), island0_, {"x", ""}));
    ShardedArray x = many.back();
    for (int i = 0; i < 20; ++i) x = (*client_->Call(inc_mid, island0_, {x}))[0];  // on their way while
    const int64_t carried = client_->stats().frees_carried;
    many.clear();  // the 40 are dropped
    x = (*client_->Call(inc_mid, island0_, {x}))[0];  // carries what was held
    ASSERT_TRUE(client_->Ready(x).Await().ok());
    // 1 MiB held at most, in 64 KiB shards (ClientCore::kMaxHeldBytes, kMaxCarriedShardBytes).
    EXPECT_LE(client_->stats().frees_carried - carried, 16);
  }
  // On both hosts, once every free the loop left is applied, only this put's shards are new.
  auto small = *client_->Put(*HostArray::Create(DType::kF32, {2, 4}), slice8_, {"x", "y"});
  ASSERT_TRUE(client_->Ready(small).Await().ok());
  EXPECT_EQ(buffers(), buffers_before + 8);
}

// A free held for a run that never comes goes as free ops by itself, a few ms after the last
// run was delivered, with nothing else sent to move it: in a loop that waits for each result, and
// when it ends.
TEST_F(ClientTest, AHeldFreeGoesByItselfWhenNoRunFollows) {
  const TensorSpec spec{DType::kF32, {4}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  Worker& w = cluster_->worker(0);
  const size_t before = w.runtime().store().num_buffers();
  {
    ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {4}), island0_, {"x"});
    for (int i = 0; i < 30; ++i) {
      x = (*client_->Call(inc, island0_, {x}))[0];
      ASSERT_TRUE(client_->Ready(x).Await().ok());
    }
    // Only x's shards are left once the last free (held when the last run went) is applied.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (w.runtime().store().num_buffers() != before + 4 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));  // polls the condition; bounded by the deadline
    }
    EXPECT_EQ(w.runtime().store().num_buffers(), before + 4);
  }
}

// A loop's runs over one set of hosts name them once: after that a run names its group and its
// number in the group's epoch, and the controller gives it its place on each host. Anything
// else that takes a place on one of the hosts (a put, a free op, a run over other hosts) starts
// a new epoch, whose first run names every host again; the values show that each run still
// came after what was pushed before it and before what was pushed after.
TEST_F(ClientTest, ARunNamesItsHostsOnlyWhenSomethingElseTookAPlaceOnThem) {
  const TensorSpec row{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice8_, {"x"});
  // The first run registers the program on its hosts and names them.
  const int64_t named_before = client_->stats().runs_naming_hosts;
  x = (*client_->Call(inc, slice8_, {x}))[0];
  const ClientStats before = client_->stats();
  EXPECT_EQ(before.runs_naming_hosts - named_before, 1);
  for (int i = 1; i < 40; ++i) x = (*client_->Call(inc, slice8_, {x}))[0];
  ClientStats after = client_->stats();
  EXPECT_EQ(after.run_ops_sent - before.run_ops_sent, 39);
  // Each run carries the free of the array the run before it made, unless the loop paused for
  // longer than the client holds frees (ClientCore::kFreeWait, a few ms: a loaded machine can
  // deschedule it that long). Then the frees went as ops (runs go to the scheduler, so every op
  // counted here is such a free), which took places on the hosts, and the next run named them
  // again. When none did, no run after the first names its hosts.
  const int64_t free_ops = after.ops_sent - before.ops_sent;
  EXPECT_LE(after.runs_naming_hosts - before.runs_naming_hosts, free_ops);
  if (free_ops > 0) std::cerr << free_ops << " frees went as ops in the loop\n";
  auto got = client_->Fetch(x).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(got.ok()) << got.status();
  for (float f : Values(*got)) EXPECT_EQ(f, 40.0f);

  // A put to one of the hosts between two runs: the run after it names its hosts, and reads
  // the put's values.
  const ClientStats mixed_before = client_->stats();
  for (int i = 0; i < 10; ++i) {
    ShardedArray y = *client_->Put(Iota({8}, static_cast<float>(i)), slice8_, {"x"});
    auto out = client_->Fetch((*client_->Call(inc, slice8_, {y}))[0]).AwaitFor(absl::Seconds(60));
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<float> want = Values(Iota({8}, static_cast<float>(i)));
    for (size_t e = 0; e < want.size(); ++e) ASSERT_EQ(Values(*out)[e], want[e] + 1.0f) << i << " " << e;
  }
  EXPECT_EQ(client_->stats().runs_naming_hosts - mixed_before.runs_naming_hosts, 10);

  // Runs of two groups that share a host, alternating (island0_'s host is one of slice8_'s), and
  // the one-host group's array fetched after runs of the other took places after it.
  ShardedArray a = *client_->Put(*HostArray::Create(DType::kF32, {4}), island0_, {"x"});
  const TensorSpec four{DType::kF32, {4}};
  auto inc4 = *client_->Compile(FunctionSpec::Builtin("add_one", {four}, {four}, {{"x"}}, {{"x"}}));
  for (int i = 0; i < 12; ++i) {
    a = (*client_->Call(inc4, island0_, {a}))[0];
    x = (*client_->Call(inc, slice8_, {x}))[0];
  }
  auto got_a = client_->Fetch(a).AwaitFor(absl::Seconds(60));
  auto got_x = client_->Fetch(x).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(got_a.ok() && got_x.ok()) << got_a.status() << " " << got_x.status();
  for (float f : Values(*got_a)) EXPECT_EQ(f, 12.0f);
  for (float f : Values(*got_x)) EXPECT_EQ(f, 52.0f);
  // An array made early in an epoch reads back right after later runs of the epoch.
  ShardedArray first = (*client_->Call(inc, slice8_, {x}))[0];
  for (int i = 0; i < 5; ++i) x = (*client_->Call(inc, slice8_, {x}))[0];
  auto got_first = client_->Fetch(first).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(got_first.ok()) << got_first.status();
  for (float f : Values(*got_first)) EXPECT_EQ(f, 53.0f);
}

// Shards of kStagedPutBytes and more go ahead over the workers' data streams (once the client
// knows where a worker's stream is) and the put ops that name them follow in the client's order:
// a call right after a put reads the put's values, and the staged buffers free as any others.
TEST_F(ClientTest, LargePutsGoAheadOverDataStreamsAndKeepTheirPlaceInOrder) {
  constexpr int64_t kRows = 8, kCols = 16 << 10;  // 256 KiB per device over x = 2
  const TensorSpec spec{DType::kF32, {kRows, kCols}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x", ""}}, {{"x", ""}}));
  const HostArray data = Iota({kRows, kCols});
  Worker& w = cluster_->worker(0);
  std::vector<int64_t> used_before;
  for (int i = 0; i < w.runtime().num_devices(); ++i) used_before.push_back(w.runtime().device(i).stats().memory_used);
  // The first puts go through gRPC while the client asks each worker where its stream is.
  for (int i = 0; i < 100 && client_->stats().staged_put_bytes == 0; ++i) {
    auto warm = *client_->Put(data, slice8_, {"x", ""});
    ASSERT_TRUE(client_->Ready(warm).Await().ok());
  }
  const int64_t staged_before = client_->stats().staged_put_bytes;
  ASSERT_GT(staged_before, 0) << "no put went over a data stream";
  for (int i = 0; i < 5; ++i) {
    ShardedArray x = *client_->Put(data, slice8_, {"x", ""});
    auto got = client_->Fetch((*client_->Call(inc, slice8_, {x}))[0]).Await();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t e = 0; e < got->num_elements(); ++e) {
      ASSERT_EQ(got->data<float>()[e], data.data<float>()[e] + 1.0f) << "element " << e << " of run " << i;
    }
  }
  // Eight shards of 256 KiB per put.
  EXPECT_GE(client_->stats().staged_put_bytes - staged_before, 5 * 8 * (256 << 10));
  for (int i = 0; i < w.runtime().num_devices(); ++i) {
    EXPECT_TRUE(w.runtime().device(i).WaitForMemoryUsedAtMost(used_before[i], absl::Seconds(30))) << i;
  }
}

// Stages alternate between the two hosts, so every node's input crosses hosts. One host sets up
// its run ops late, so blocks reach it before it expects them; the other host sees the reverse.
TEST_F(ClientTest, PingPongProgramAcrossHostsManyRuns) {
  cluster_->worker(1).runtime().TEST_DelayRunOps(absl::Milliseconds(2));
  const TensorSpec spec{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ProgramBuilder builder("ping_pong");
  TracedValue v = builder.Arg(spec);
  for (int s = 0; s < 6; ++s) v = (*builder.Call(inc, s % 2 == 0 ? island1_ : island0_, {v}))[0];
  Program program = *builder.Build({v});
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), island0_, {"x"});
  for (int run = 0; run < 30; ++run) {
    RunOptions options{run % 3 == 0 ? RunOptions::Dispatch::kSequential : RunOptions::Dispatch::kParallel};
    auto out = client_->Run(program, {x}, options);
    ASSERT_TRUE(out.ok()) << out.status();
    x = (*out)[0];
  }
  auto result = client_->Fetch(x).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(result.ok()) << result.status();
  for (float f : Values(*result)) EXPECT_EQ(f, 180.0f);
  cluster_->worker(1).runtime().TEST_DelayRunOps(absl::ZeroDuration());
}

// A chain whose first node fails fails every later node with that cause, named once: each node
// down the chain does not name its own failed input again.
TEST_F(ClientTest, AFailureAtTheHeadOfAChainIsToldOnceAtItsEnd) {
  const TensorSpec spec{DType::kF32, {8}};
  auto boom = *client_->Compile(
      FunctionSpec::Script("boom", "def boom(x):\n    assert bool(x.sum() < -1000.0), 'kaboom'\n    return x\n", {spec},
                           {spec}, {{"x"}}, {{"x"}}));
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ProgramBuilder builder("failing_chain");
  TracedValue v = (*builder.Call(boom, island0_, {builder.Arg(spec)}))[0];
  for (int n = 0; n < 20; ++n) v = (*builder.Call(inc, island0_, {v}))[0];
  Program program = *builder.Build({v});
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), island0_, {"x"});
  auto out = client_->Run(program, {x});
  ASSERT_TRUE(out.ok()) << out.status();
  auto fetched = client_->Fetch((*out)[0]).AwaitFor(absl::Seconds(60));
  ASSERT_FALSE(fetched.ok());
  const std::string message(fetched.status().message());
  EXPECT_NE(message.find("kaboom"), std::string::npos) << message;
  EXPECT_EQ(Count(message, "input of '"), 1) << message;
}

// The client is thread-safe: runs submitted from several threads at once, crossing hosts, each
// get their own correct results.
TEST_F(ClientTest, ConcurrentRunsFromSeveralThreads) {
  const TensorSpec spec{DType::kF32, {8}};
  auto inc = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ProgramBuilder builder("hop");
  TracedValue v = builder.Arg(spec);
  v = (*builder.Call(inc, island1_, {v}))[0];
  v = (*builder.Call(inc, island0_, {v}))[0];
  Program program = *builder.Build({v});
  std::vector<std::thread> threads;
  std::vector<float> results(4, -1);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), island0_, {"x"});
      for (int run = 0; run < 15; ++run) {
        RunOptions options{(run + t) % 4 == 0 ? RunOptions::Dispatch::kSequential : RunOptions::Dispatch::kParallel};
        x = (*client_->Run(program, {x}, options))[0];
      }
      auto r = client_->Fetch(x).AwaitFor(absl::Seconds(60));
      if (r.ok()) results[t] = r->data<float>()[3];
    });
  }
  for (auto& t : threads) t.join();
  for (float r : results) EXPECT_EQ(r, 30.0f);
}

TEST_F(ClientTest, EnqueuedCompletesOnceTheRunIsOnItsHosts) {
  const TensorSpec spec{DType::kF32, {4}};
  auto fn = *client_->Compile(FunctionSpec::Builtin("add_one", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(Iota({4}), island0_, {"x"});
  EXPECT_TRUE(client_->Enqueued(x).Await().ok());  // a Put is on its hosts' queues at once
  // Applied, too: a run that reached the host before the Put would wait for it (the client's
  // order), and its output would not have an entry yet when the run is acknowledged.
  ASSERT_TRUE(client_->Ready(x).Await().ok());
  // The same for the programs the first calls register (one per input placement: the Put's and
  // a run's output's), which go to the host directly: a run that overtakes its registration waits
  // on the host for it, acknowledged but not applied (seen under load, 1 in 10).
  std::vector<ShardedArray> outputs;
  for (int i = 0; i < 2; ++i) {
    x = (*client_->Call(fn, island0_, {x}))[0];
    outputs.push_back(x);
  }
  ASSERT_TRUE(client_->Ready(x).Await().ok()) << client_->Ready(x).Await().status();
  // The paper's OpByOp client: each call waits for its run to be enqueued before the next.
  // Every output is kept: dropping one would send a Free straight to the host, and a run that
  // reaches the host before an earlier Free of its client waits there for it (the client's
  // order), enqueued but not yet applied.
  ObjectStore& store = cluster_->worker(0).runtime().store();  // island 0's one host
  for (int i = 0; i < 5; ++i) {
    x = (*client_->Call(fn, island0_, {x}))[0];
    outputs.push_back(x);
    ASSERT_TRUE(client_->Enqueued(x).Await().ok());
    // The host has applied the run: its output has an entry (computed or not), not NotFound.
    Future<BufferPtr> out = store.Get(client_->id(), {x.id(), 0});
    EXPECT_FALSE(out.IsReady() && absl::IsNotFound(out.Await().status())) << "call " << i;
  }
  std::vector<float> expected = Values(Iota({4}));
  for (float& v : expected) v += 7.0f;
  EXPECT_EQ(Values(*client_->Fetch(x).Await()), expected);
}

// Random numbers in compiled functions: each shard draws its block of one global array, so the
// fetched array is the global draw whatever the sharding, replicas agree, and dropout's mask is
// the same draw.
TEST_F(ClientTest, RandomNumbersAreOneGlobalDrawAcrossShards) {
  const TensorSpec dummy{DType::kF32, {2, 4}};
  const TensorSpec global{DType::kF32, {8, 16}};
  // On the 2x4 mesh, rows split over x (local [4, 16]) and replicated over y.
  auto draw = client_->Compile(FunctionSpec::Script(
      "draw",
      "def draw(d):\n"
      "    u = pathways.uniform([4, 16], ['x', ''], 7, 3)\n"
      "    spread = pathways.all_reduce(u, 'y', 'max') - pathways.all_reduce(u, 'y', 'min')\n"
      "    return u, spread, pathways.dropout(torch.ones([4, 16]), 0.25, ['x'], 7, 3)\n",
      {dummy}, {global, global, global}, {{"x", "y"}}, {{"x", ""}, {"x", ""}, {"x", ""}}));
  ASSERT_TRUE(draw.ok()) << draw.status();
  auto d = client_->Put(Iota({2, 4}), slice8_, {"x", "y"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto out = client_->Call(*draw, slice8_, {*d});
  ASSERT_TRUE(out.ok()) << out.status();
  auto u = client_->Fetch((*out)[0]).Await();
  auto spread = client_->Fetch((*out)[1]).Await();
  auto dropped = client_->Fetch((*out)[2]).Await();
  ASSERT_TRUE(u.ok() && spread.ok() && dropped.ok()) << u.status() << spread.status() << dropped.status();
  std::vector<float> expected(8 * 16);
  FillRandom(RandomDistribution::kUniform, 7, 3, {8, 16}, {0, 0}, {8, 16}, expected.data());
  for (int i = 0; i < 8 * 16; ++i) {
    EXPECT_EQ(u->data<float>()[i], expected[i]) << i;
    EXPECT_EQ(spread->data<float>()[i], 0.0f) << i;  // the four replicas over y agree
    EXPECT_EQ(dropped->data<float>()[i], expected[i] >= 0.25f ? 1.0f / 0.75f : 0.0f) << i;
  }
  // Two row blocks of one draw differ.
  EXPECT_NE(std::vector<float>(u->data<float>(), u->data<float>() + 64),
            std::vector<float>(u->data<float>() + 64, u->data<float>() + 128));
}

// A collective on a constant: TorchScript's optimiser once ran it at the first call, on one
// shard's thread, and that shard waited for members that waited for the optimiser.
TEST_F(ClientTest, ACollectiveOfAConstantRunsOnEveryShard) {
  auto f = client_->Compile(FunctionSpec::Script(
      "count", "def count(d):\n    return pathways.all_reduce(torch.ones([1, 1]), 'y') + d\n",
      {{DType::kF32, {2, 4}}}, {{DType::kF32, {2, 4}}}, {{"x", "y"}}, {{"x", "y"}}));
  ASSERT_TRUE(f.ok()) << f.status();
  auto d = client_->Put(Iota({2, 4}), slice8_, {"x", "y"});
  ASSERT_TRUE(d.ok()) << d.status();
  auto out = client_->Call(*f, slice8_, {*d});
  ASSERT_TRUE(out.ok()) << out.status();
  auto r = client_->Fetch((*out)[0]).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(r->data<float>()[i], Iota({2, 4}).data<float>()[i] + 4) << i;
}

}  // namespace
}  // namespace pathways
