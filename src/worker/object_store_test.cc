#include "worker/object_store.h"

#include "device/cpu_device.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(ObjectStoreTest, HandlesResolveOnlyWithinTheirClient) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  store.Put("alice", {ArrayId(1), 0}, Future<BufferPtr>::Ready(*device.Allocate(DType::kF32, {4})));
  EXPECT_TRUE(store.Get("alice", {ArrayId(1), 0}).Await().ok());
  EXPECT_EQ(store.Get("bob", {ArrayId(1), 0}).Await().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Get("alice", {ArrayId(1), 1}).Await().status().code(), absl::StatusCode::kNotFound);
}

TEST(ObjectStoreTest, FreeDropsBuffersButNotWhatQueuedWorkHolds) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  for (int s = 0; s < 3; ++s) {
    store.Put("c", {ArrayId(7), s}, Future<BufferPtr>::Ready(*device.Allocate(DType::kF32, {256})));
  }
  Future<BufferPtr> held = store.Get("c", {ArrayId(7), 1});
  EXPECT_EQ(device.stats().memory_used, 3 * 1024);
  EXPECT_EQ(store.FreeArray("c", ArrayId(7)), 3);
  EXPECT_EQ(store.num_buffers(), 0u);
  EXPECT_EQ(device.stats().memory_used, 1024);  // the held shard is still alive
  held = Future<BufferPtr>();
  EXPECT_EQ(device.stats().memory_used, 0);
}

TEST(ObjectStoreTest, TransferRendezvousInEitherOrder) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  // Consumer first.
  Future<BufferPtr> f = store.ExpectTransfer("c", {Epoch(1), 0, 0, 0, 5});
  EXPECT_FALSE(f.IsReady());
  store.DeliverTransfer("c", {Epoch(1), 0, 0, 0, 5}, *device.Allocate(DType::kI32, {2}));
  EXPECT_TRUE(f.Await().ok());
  // Producer first.
  store.DeliverTransfer("c", {Epoch(1), 0, 0, 0, 6}, absl::UnavailableError("source host lost"));
  EXPECT_EQ(store.ExpectTransfer("c", {Epoch(1), 0, 0, 0, 6}).Await().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store.num_pending_transfers(), 0u);
  // Same key, another client: a separate transfer.
  Future<BufferPtr> other = store.ExpectTransfer("d", {Epoch(1), 0, 0, 0, 5});
  EXPECT_FALSE(other.IsReady());
}

TEST(ObjectStoreTest, BlocksDeliveredBeforeTheirConsumerAreCountedUntilClaimedOrDropped) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  store.DeliverTransfer("c", {Epoch(1), 0, 0, 0, 1}, *device.Allocate(DType::kF32, {100}));   // 400 bytes
  store.DeliverTransfer("c", {Epoch(1), 1, 0, 0, 1}, *device.Allocate(DType::kF32, {50}));    // 200 bytes
  store.DeliverTransfer("d", {Epoch(1), 0, 0, 0, 1}, *device.Allocate(DType::kF32, {25}));    // 100 bytes
  store.DeliverTransfer("c", {Epoch(1), 2, 0, 0, 1}, absl::UnavailableError("no data, no bytes"));
  EXPECT_EQ(store.unclaimed_bytes(), 700);
  EXPECT_TRUE(store.ExpectTransfer("c", {Epoch(1), 0, 0, 0, 1}).Await().ok());  // claimed
  EXPECT_EQ(store.unclaimed_bytes(), 300);
  store.FailUndeliveredTransfers("c", Epoch(1), 0, 5, absl::InternalError("epoch over"));  // never expected: dropped
  EXPECT_EQ(store.unclaimed_bytes(), 100);
  store.DropClient("d", absl::CancelledError("gone"));
  EXPECT_EQ(store.unclaimed_bytes(), 0);
  // Delivered to a consumer that waits: never counted.
  Future<BufferPtr> waiting = store.ExpectTransfer("c", {Epoch(2), 0, 0, 0, 1});
  store.DeliverTransfer("c", {Epoch(2), 0, 0, 0, 1}, *device.Allocate(DType::kF32, {100}));
  EXPECT_EQ(store.unclaimed_bytes(), 0);
}

// Ops of a client that never reached the host and were skipped: what they were to make is unknown,
// so every shard the client lacks reads as missing with that reason, until the client goes.
TEST(ObjectStoreTest, ShardsAClientLacksAfterItsOpsWereSkippedSayWhy) {
  ObjectStore store;
  store.NoteSkippedOps("c", absl::DeadlineExceededError("ops 4..5 of session 1 never came within 10s"));
  auto missing = store.Get("c", {ArrayId(7), 1}).Await();
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no shard 1 of array 7"), std::string::npos) << missing.status();
  EXPECT_NE(missing.status().message().find("ops 4..5 of session 1 never came"), std::string::npos) << missing.status();
  EXPECT_EQ(store.Get("other", {ArrayId(7), 1}).Await().status().message().find("never came"), std::string::npos);
  store.DropClient("c", absl::CancelledError("gone"));
  EXPECT_EQ(store.Get("c", {ArrayId(7), 1}).Await().status().message().find("never came"), std::string::npos);
}

}  // namespace
}  // namespace pathways

namespace pathways {
namespace {

TEST(ObjectStoreTest, UndeliveredTransfersOfAFinishedEpochFail) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  Future<BufferPtr> arrives = store.ExpectTransfer("c", {Epoch(7), 0, 0, 1, 0});
  Future<BufferPtr> never = store.ExpectTransfer("c", {Epoch(7), 1, 0, 1, 0});
  Future<BufferPtr> later_node = store.ExpectTransfer("c", {Epoch(7), 2, 0, 1, 0});
  Future<BufferPtr> other_run = store.ExpectTransfer("c", {Epoch(8), 1, 0, 1, 0});
  store.DeliverTransfer("c", {Epoch(7), 0, 0, 1, 0}, *device.Allocate(DType::kF32, {1}));
  EXPECT_EQ(store.FailUndeliveredTransfers("c", Epoch(7), 0, 1, absl::InternalError("lost")), 1);
  EXPECT_TRUE(arrives.Await().ok());
  EXPECT_EQ(never.Await().status().code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(later_node.IsReady());  // node 2 is outside the finished range
  EXPECT_FALSE(other_run.IsReady());
}

// A run whose exchange lost a batch: its blocks that come after it failed are dropped, not
// held unclaimed for an epoch end that will not come.
TEST(ObjectStoreTest, TransfersFailedForGoodDropWhatComesForThemLater) {
  CpuDevice device(0, 1 << 20);
  ObjectStore store;
  Future<BufferPtr> lost = store.ExpectTransfer("c", {Epoch(7), 1, 0, 1, 0});
  Future<BufferPtr> other_run = store.ExpectTransfer("c", {Epoch(8), 1, 0, 1, 0});
  EXPECT_EQ(store.FailTransfersForGood("c", Epoch(7), 0, 1, absl::UnavailableError("lost")), 1);
  EXPECT_EQ(lost.Await().status().code(), absl::StatusCode::kUnavailable);
  store.DeliverTransfer("c", {Epoch(7), 1, 0, 1, 0}, *device.Allocate(DType::kF32, {100}));
  EXPECT_EQ(store.unclaimed_bytes(), 0);
  EXPECT_FALSE(other_run.IsReady());
  EXPECT_EQ(store.num_pending_transfers(), 2u);  // the failed one stays, holding nothing, with the other run's
  store.DropClient("c", absl::CancelledError("gone"));
  EXPECT_EQ(store.num_pending_transfers(), 0u);
}

TEST(ObjectStoreTest, ArraysWhoseOpFailedReadAsThatFailureUntilTheClientGoes) {
  ObjectStore store;
  store.FailArrays("c", ArrayId(10), 2, absl::ResourceExhaustedError("device 0 is full"));
  auto failed = store.Get("c", {ArrayId(11), 0}).Await();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("device 0 is full"), std::string::npos) << failed.status();
  EXPECT_EQ(store.Get("c", {ArrayId(12), 0}).Await().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.Get("other", {ArrayId(11), 0}).Await().status().code(), absl::StatusCode::kNotFound);
  for (int i = 0; i < static_cast<int>(ObjectStore::kFailedRangesPerClient); ++i) {
    store.FailArrays("c", ArrayId(1000 + i), 1, absl::InternalError("x"));
  }
  EXPECT_EQ(store.Get("c", {ArrayId(11), 0}).Await().status().code(), absl::StatusCode::kNotFound);  // bounded: forgotten
  store.FailArrays("c", ArrayId(10), 2, absl::ResourceExhaustedError("device 0 is full"));
  store.DropClient("c", absl::CancelledError("gone"));
  EXPECT_EQ(store.Get("c", {ArrayId(11), 0}).Await().status().code(), absl::StatusCode::kNotFound);
}

// Blocks expected from a host that left fail, pending ones at once and later ones when expected,
// naming the host and why it left when the controller knows.
TEST(ObjectStoreTest, BlocksFromAHostThatLeftFailWithWhyItLeft) {
  ObjectStore store;
  Future<BufferPtr> pending = store.ExpectTransfer("c", {Epoch(1), 0, 0, 0, 1}, "a:1");
  Future<BufferPtr> other = store.ExpectTransfer("c", {Epoch(1), 0, 0, 0, 2}, "b:1");
  EXPECT_EQ(store.SetDepartedHosts({{"a:1", "host b:1 could not deliver dataflow batches to a:1"}, {"s:1", ""}}), 1);
  auto failed = pending.Await();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(failed.status().message().find("host a:1 left the cluster: host b:1 could not deliver"), std::string::npos)
      << failed.status();
  EXPECT_NE(failed.status().message().find("a block of run 1"), std::string::npos) << failed.status();
  EXPECT_FALSE(other.IsReady());
  auto silent = store.ExpectTransfer("c", {Epoch(2), 0, 0, 0, 1}, "s:1").Await();
  EXPECT_NE(silent.status().message().find("host s:1 left the cluster (it stopped heartbeating"), std::string::npos)
      << silent.status();
}

}  // namespace
}  // namespace pathways
