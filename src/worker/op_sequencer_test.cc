#include "worker/op_sequencer.h"

#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

rpc::Op Direct(int64_t seq, int64_t session, bool filler = false) {
  rpc::Op op;
  op.set_seq(seq);
  op.set_session(session);
  if (filler) {
    op.mutable_skip();
  } else {
    op.mutable_free()->set_array_id(seq);
  }
  return op;
}

rpc::ScheduledOp Scheduled(const std::string& client, int64_t seq, int64_t session) {
  rpc::ScheduledOp s;
  s.set_client_id(client);
  s.mutable_op()->set_seq(seq);
  s.mutable_op()->set_session(session);
  s.mutable_op()->mutable_run()->set_epoch(seq);
  return s;
}

class OpSequencerTest : public ::testing::Test {
 protected:
  std::vector<int64_t> applied_;  // sequence numbers, in the order applied
  OpSequencer sequencer_{[this](const std::string&, const rpc::Op& op) { applied_.push_back(op.seq()); },
                         [](const std::string&) {}, absl::Hours(1)};
};

TEST_F(OpSequencerTest, DirectAndScheduledOpsAreAppliedInTheClientsOrder) {
  ASSERT_TRUE(sequencer_.AddScheduled({Scheduled("c", 2, 7)}).ok());  // waits for op 1
  EXPECT_TRUE(applied_.empty());
  ASSERT_TRUE(sequencer_.AddDirect("c", {Direct(1, 7), Direct(3, 7)}).ok());
  EXPECT_EQ(applied_, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(sequencer_.WhenApplied("c", 7, 3).IsReady());
}

TEST_F(OpSequencerTest, AFillerForANumberAlreadyAppliedIsMootButARealOpIsRefused) {
  // The scheduler refused run 1 because another host of its gang left, but it reached this
  // host: the client then fills number 1 here too, and that must not break its sequence.
  ASSERT_TRUE(sequencer_.AddScheduled({Scheduled("c", 1, 7)}).ok());
  EXPECT_TRUE(sequencer_.AddDirect("c", {Direct(1, 7, /*filler=*/true), Direct(2, 7)}).ok());
  EXPECT_EQ(applied_, (std::vector<int64_t>{1, 2}));
  absl::Status again = sequencer_.AddDirect("c", {Direct(2, 7)});
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument) << again;
}

// A client killed after its run reached the island but before its own ops to this host did: once
// its retirement is queued behind the run, the run goes ahead at once (the gap timeout here is an
// hour, so nothing else could let it), and later ops of the client are refused.
TEST_F(OpSequencerTest, AGapOfAClientWhoseRetirementIsQueuedClosesAtOnce) {
  ASSERT_TRUE(sequencer_.AddScheduled({Scheduled("gone", 3, 7)}).ok());  // ops 1 and 2 never come
  EXPECT_TRUE(applied_.empty());
  rpc::ScheduledOp retire;
  retire.set_client_id("gone");
  retire.set_retire_client(true);
  ASSERT_TRUE(sequencer_.AddScheduled({retire, Scheduled("other", 1, 1)}).ok());
  EXPECT_EQ(applied_, (std::vector<int64_t>{3, 1}));  // the run, then the next client's
  EXPECT_FALSE(sequencer_.AddDirect("gone", {Direct(1, 7)}).ok());
}

// Ops that never come: after the gap timeout the scheduled run goes ahead without them, and the
// host hears which were skipped and why (what they were to make will be missing there).
TEST(OpSequencerGapTest, OpsThatNeverComeAreSkippedAndNamed) {
  std::vector<int64_t> applied;
  std::vector<std::pair<std::string, absl::Status>> skipped;
  OpSequencer sequencer([&](const std::string&, const rpc::Op& op) { applied.push_back(op.seq()); },
                        [](const std::string&) {}, absl::Milliseconds(50), OpSequencer::Limits{},
                        [&](const std::string& client, const absl::Status& why) { skipped.emplace_back(client, why); });
  ASSERT_TRUE(sequencer.AddScheduled({Scheduled("c", 3, 7)}).ok());  // ops 1 and 2 never come
  ASSERT_TRUE(sequencer.WhenApplied("c", 7, 3).AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(applied, (std::vector<int64_t>{3}));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].first, "c");
  EXPECT_EQ(skipped[0].second.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(skipped[0].second.message().find("ops 1..2 of session 7 never came within 50ms"), std::string::npos)
      << skipped[0].second;
  EXPECT_FALSE(sequencer.AddDirect("c", {Direct(1, 7)}).ok());  // refused when it comes after all
}

// Ops that came early are held within byte limits, per client and in all; an op next in its
// sequence is applied at once and never counted, however large; what was held is released once
// it is applied.
TEST(OpSequencerLimitsTest, OpsHeldForEarlierOnesAreBoundedInBytes) {
  std::vector<int64_t> applied;
  OpSequencer sequencer([&](const std::string&, const rpc::Op& op) { applied.push_back(op.seq()); },
                        [](const std::string&) {}, absl::Hours(1),
                        OpSequencer::Limits{.waiting_bytes_per_client = 3000, .waiting_bytes = 5000});
  auto put = [](int64_t seq, int64_t session, size_t bytes) {
    rpc::Op op = Direct(seq, session);
    op.mutable_put()->set_data(std::string(bytes, 'x'));
    return op;
  };
  // Larger than every limit, but next in sequence: applied.
  ASSERT_TRUE(sequencer.AddDirect("a", {put(1, 1, 10000)}).ok());
  // Op 2 is a run the island has not scheduled yet: 3 and 4 wait for it; 5 is past the client's limit.
  ASSERT_TRUE(sequencer.AddDirect("a", {put(3, 1, 1400), put(4, 1, 1400)}).ok());
  absl::Status over = sequencer.AddDirect("a", {put(5, 1, 1400)});
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_NE(over.message().find("client a"), std::string::npos) << over;
  // Another session of the same client counts against the same limit.
  EXPECT_EQ(sequencer.AddDirect("a", {put(2, 2, 1400)}).code(), absl::StatusCode::kResourceExhausted);
  // Another client has its own, up to the limit of all clients together (5000 bytes).
  ASSERT_TRUE(sequencer.AddDirect("b", {put(2, 1, 1400)}).ok());
  EXPECT_EQ(sequencer.AddDirect("b", {put(3, 1, 1400)}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(applied, (std::vector<int64_t>{1}));

  // The run comes: 3 and 4 go, and what they held is free again.
  ASSERT_TRUE(sequencer.AddScheduled({Scheduled("a", 2, 1)}).ok());
  EXPECT_EQ(applied, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_TRUE(sequencer.AddDirect("a", {put(6, 1, 1400)}).ok());  // waits for the refused 5
  EXPECT_TRUE(sequencer.AddDirect("b", {put(3, 1, 1400)}).ok());
}

}  // namespace
}  // namespace pathways
