// DataflowService on its own: what it holds for graphs not set up yet, its bounds, and what a
// graph hears it lost.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "dataflow/control_graph.h"
#include "dataflow/dataflow_service.h"
#include "dataflow/engine.h"
#include "gtest/gtest.h"
#include "testing/sparse_sum_graph.h"

namespace pathways::dataflow {
namespace {

// An engine of `graph` on host "h", as a service hands batches to; its pool stops first.
struct LocalEngine {
  explicit LocalEngine(std::shared_ptr<const GraphDef> graph)
      : engine(std::make_shared<Engine>("h", std::move(graph), SparseSumOperators(results), transport, pool)) {}
  ~LocalEngine() { pool.Shutdown(); }
  SparseSumResults results;
  LocalTransport transport;
  ThreadPool pool{"h", 1};
  std::shared_ptr<Engine> engine;
};

TEST(DataflowTest, BatchesForAGraphNotYetHereAreHeldAndForOneGoneAreDropped) {
  auto graph = MakeSparseSumGraph({"h", "h", "h"});
  LocalEngine local(graph);
  const std::shared_ptr<Engine>& engine = local.engine;
  DataflowService service;
  Envelope stray;
  stray.edge = -1;  // handled as an envelope on no edge: logged and ignored
  service.Receive("peer", graph->name(), {stray});
  EXPECT_EQ(service.num_held_batches(), 1u);  // the graph may still be set up here
  (void)service.AddEngine(engine.get());
  EXPECT_EQ(service.num_held_batches(), 0u);  // handed over
  service.RemoveEngine(graph->name());
  service.Receive("peer", graph->name(), {stray});
  EXPECT_EQ(service.num_held_batches(), 0u);  // a straggler: dropped
}

TEST(DataflowTest, WhatIsHeldForUnknownGraphsIsBoundedInBytes) {
  DataflowService service;
  service.SetHoldLimits(/*bytes=*/10000, /*bytes_per_graph=*/4000, /*bytes_per_peer=*/10000);
  auto batch = [](size_t payload) {
    Envelope e;
    e.payload.assign(payload, 'x');
    return std::vector<Envelope>{e};
  };
  service.Receive("peer", "a", batch(3000));
  service.Receive("peer", "a", batch(3000));  // past the graph's bound: dropped
  EXPECT_EQ(service.num_held_batches(), 1u);
  service.Receive("peer", "b", batch(3000));
  service.Receive("peer", "c", batch(3000));
  service.Receive("peer", "d", batch(3000));  // past the bound in all: dropped
  EXPECT_EQ(service.num_held_batches(), 3u);
  EXPECT_LE(service.num_held_bytes(), 10000u);
  // Registering a graph hands its batches over and frees their room.
  auto graph = MakeSparseSumGraph({"h", "h", "h"});
  LocalEngine local(graph);
  const std::shared_ptr<Engine>& engine = local.engine;
  Envelope stray;
  stray.edge = -1;  // handled as an envelope on no edge: logged and ignored
  service.Receive("peer", graph->name(), {stray});
  EXPECT_EQ(service.num_held_batches(), 4u);
  (void)service.AddEngine(engine.get());
  EXPECT_EQ(service.num_held_batches(), 3u);
  service.RemoveEngine(graph->name());
}

// One peer cannot take the room of the others, and a graph that lost batches from one of its
// hosts before it came is told which epochs lost one and why.
TEST(DataflowTest, APeerGetsItsShareOfTheHeldBytesAndAGraphHearsWhatItLost) {
  DataflowService service;
  service.SetHoldLimits(/*bytes=*/100000, /*bytes_per_graph=*/100000, /*bytes_per_peer=*/7000);
  auto batch = [](int64_t epoch) {
    Envelope e;
    e.epoch = epoch;
    e.edge = -1;  // handled as an envelope on no edge: logged and ignored
    e.payload.assign(3000, 'x');
    return std::vector<Envelope>{e};
  };
  auto graph = MakeSparseSumGraph({"p", "h", "h"});  // "p" sends too much, "q" sends its share
  service.Receive("p", graph->name(), batch(1));
  service.Receive("p", graph->name(), batch(2));
  service.Receive("p", graph->name(), batch(3));  // past p's bound: dropped
  service.Receive("p", "other", batch(1));         // so is this, for any graph
  EXPECT_EQ(service.num_held_batches(), 2u);
  EXPECT_EQ(service.batches_dropped(), 2);
  service.Receive("q", graph->name(), batch(4));  // another peer still has room
  EXPECT_EQ(service.num_held_batches(), 3u);
  for (int i = 0; i < 3; ++i) service.Receive("stranger", graph->name(), batch(5));  // not one of its hosts

  LocalEngine local(graph);
  const std::shared_ptr<Engine>& engine = local.engine;
  const LostEpochs lost = service.AddEngine(engine.get());
  EXPECT_EQ(service.num_held_batches(), 0u);  // every held batch handed over
  EXPECT_TRUE(lost.Has(3));
  EXPECT_FALSE(lost.Has(1) || lost.Has(2) || lost.Has(4));
  EXPECT_FALSE(lost.Has(5));  // the stranger's batch was not the graph's
  EXPECT_NE(lost.why.find("from p came before the graph was set up"), std::string::npos) << lost.why;
  // Handed over once: a graph registered again later starts with nothing lost.
  service.RemoveEngine(graph->name());
  EXPECT_TRUE(service.AddEngine(engine.get()).empty());
  // The room p's handed-over batches took is its own again.
  service.Receive("p", "third", batch(6));
  service.Receive("p", "third", batch(7));
  EXPECT_EQ(service.num_held_batches(), 2u);
  service.RemoveEngine(graph->name());
}

// Programs' batches, however many, never take the room of the island control graphs' (a
// control batch dropped would break the host's order).
TEST(DataflowTest, ControlGraphsKeepTheirRoomWhenProgramsFillTheirs) {
  DataflowService service;
  service.SetHoldLimits(/*bytes=*/10000, /*bytes_per_graph=*/10000, /*bytes_per_peer=*/10000);
  Envelope e;
  e.payload.assign(3000, 'x');
  for (int i = 0; i < 4; ++i) service.Receive("p", "program", {e});  // the 4th is past the bound
  EXPECT_EQ(service.num_held_batches(), 3u);
  service.Receive("p", absl::StrCat(kControlGraphPrefix, "0/incarnation/1"), {e});
  EXPECT_EQ(service.num_held_batches(), 4u);
  EXPECT_EQ(service.batches_dropped(), 1);
  // Names past the bound are refused.
  service.Receive("p", std::string(DataflowService::kMaxNameBytes + 1, 'g'), {Envelope{}});
  EXPECT_EQ(service.num_held_batches(), 4u);
  EXPECT_EQ(service.batches_dropped(), 2);
}

// Strangers cannot push a real host's loss out of the record: senders past the list count for
// every host.
TEST(DataflowTest, LossesOfSendersPastTheListCountForEveryHost) {
  DataflowService service;
  service.SetHoldLimits(/*bytes=*/100000, /*bytes_per_graph=*/100000, /*bytes_per_peer=*/1);  // every batch dropped
  auto graph = MakeSparseSumGraph({"p", "h", "h"});
  auto batch = [](int64_t epoch) { return std::vector<Envelope>{Envelope{.epoch = epoch}}; };
  for (size_t i = 0; i < DataflowService::kMaxLostSenders; ++i) {
    service.Receive(absl::StrCat("stranger-", i), graph->name(), batch(1));
  }
  service.Receive("p", graph->name(), batch(9));
  LocalEngine local(graph);
  const std::shared_ptr<Engine>& engine = local.engine;
  const LostEpochs lost = service.AddEngine(engine.get());
  EXPECT_TRUE(lost.Has(9));
  EXPECT_FALSE(lost.Has(1));  // the strangers' own, listed, are not the graph's
  service.RemoveEngine(graph->name());
}

TEST(DataflowTest, LostEpochsPastTheListCountAsARange) {
  LostEpochs lost;
  std::vector<Envelope> batch(LostEpochs::kMaxListed + 1);
  for (size_t i = 0; i < batch.size(); ++i) batch[i].epoch = static_cast<int64_t>(2 * i + 10);
  lost.Add(batch, "why");
  const int64_t largest = batch.back().epoch;
  EXPECT_TRUE(lost.Has(11));  // within the range, though not lost: counted as lost
  EXPECT_TRUE(lost.Has(10) && lost.Has(largest));
  EXPECT_FALSE(lost.Has(9) || lost.Has(largest + 1));
  EXPECT_EQ(lost.why, "why");
  LostEpochs more;
  more.Add({Envelope{.epoch = 3}}, "other");
  more.Merge(lost);
  EXPECT_TRUE(more.Has(3) && more.Has(11) && more.Has(largest));
  EXPECT_FALSE(more.Has(4));
  EXPECT_EQ(more.why, "other");
}

}  // namespace
}  // namespace pathways::dataflow
