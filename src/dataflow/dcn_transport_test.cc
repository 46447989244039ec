#include "dataflow/dcn_transport.h"

#include <vector>

#include "gtest/gtest.h"

namespace pathways::dataflow {
namespace {

// Records when each batch reached it, and for whom.
class RecordingTransport : public Transport {
 public:
  void Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) override {
    absl::MutexLock lock(&mu_);
    sent_.push_back({host, batch.empty() ? -1 : batch[0].epoch, absl::Now()});
  }
  struct Sent {
    std::string host;
    int64_t epoch;
    absl::Time at;
  };
  std::vector<Sent> WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sent_.size() >= n; };
    mu_.Await(absl::Condition(&enough));
    return sent_;
  }

 private:
  absl::Mutex mu_;
  std::vector<Sent> sent_ ABSL_GUARDED_BY(mu_);
};

std::vector<Envelope> Batch(int64_t epoch, size_t bytes) {
  Envelope e;
  e.epoch = epoch;
  e.payload.assign(bytes, 'x');
  return {e};
}

TEST(DcnTransportTest, BatchesToAnotherIslandArriveAfterTheLinkWouldHaveCarriedThemInOrder) {
  RecordingTransport inner;
  // 10 MB/s: 100 KB take 10 ms. The latency is long enough that the three sends to the far island
  // are surely done before it passes, even in a sanitizer's build on a loaded machine.
  DcnEmulation dcn(0, {.latency = absl::Milliseconds(300), .gbps = 0.08});
  dcn.NoteHost("near", 0);
  dcn.NoteHost("far", 1);
  DcnTransport transport(inner, dcn);
  const absl::Time start = absl::Now();
  for (int64_t e = 1; e <= 3; ++e) transport.Send("far", "g", Batch(e, 100'000));
  transport.Send("near", "g", Batch(10, 100'000));
  const auto sent = inner.WaitFor(4);
  // The batch within the island went at once, before any of the held ones.
  EXPECT_EQ(sent[0].host, "near");
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(sent[i].host, "far");
    EXPECT_EQ(sent[i].epoch, i) << "batches to one peer keep their order";
    // Each waits for the latency and the wire time of those before it and its own.
    EXPECT_GE(sent[i].at - start, absl::Milliseconds(300) + i * absl::Milliseconds(10)) << "batch " << i;
  }
}

TEST(DcnTransportTest, WhatIsHeldIsDeliveredWhenTheTransportStops) {
  RecordingTransport inner;
  DcnEmulation dcn(0, {.latency = absl::Seconds(3600)});
  dcn.NoteHost("far", 1);
  {
    DcnTransport transport(inner, dcn);
    transport.Send("far", "g", Batch(1, 10));
  }
  EXPECT_EQ(inner.WaitFor(1).size(), 1u);
}

}  // namespace
}  // namespace pathways::dataflow
