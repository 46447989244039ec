#include <cstdlib>
#include <memory>
#include <regex>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "grpc/grpc.h"
#include "grpc/support/log.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "transport/auth.h"
#include "transport/ordered_batch_queue.h"
#include "transport/rpc_util.h"
#include "transport/stream_listener.h"
#include "transport/worker_client.h"

namespace pathways {
namespace {

// Items that queue up behind a batch in flight go out in batches of at most the byte limit, in
// order; an item larger than the limit goes alone.
TEST(OrderedBatchQueueTest, BatchesStayWithinTheirByteLimit) {
  absl::Mutex mu;
  std::vector<std::vector<std::string>> batches;
  std::vector<Promise<Unit>> in_flight;
  auto queue = std::make_shared<OrderedBatchQueue<std::string>>(
      [&](std::vector<std::string> batch) {
        absl::MutexLock lock(&mu);
        batches.push_back(std::move(batch));
        in_flight.emplace_back();
        return in_flight.back().future();
      },
      nullptr, OrderedBatchQueue<std::string>::BatchLimit{[](const std::string& item) { return item.size(); }, 1000});
  std::vector<std::string> items;
  for (int i = 0; i < 6; ++i) items.push_back(std::string(400, static_cast<char>('a' + i)));
  items.insert(items.begin() + 3, std::string(5000, 'z'));
  for (const auto& item : items) queue->Push(item);  // the first goes at once, the rest wait for it
  Future<Unit> flushed = queue->Flushed();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);  // a regression fails, not hangs
  for (size_t answered = 0; !flushed.AwaitFor(absl::ZeroDuration()).ok();) {
    ASSERT_LT(absl::Now(), deadline) << "batches stopped coming after " << answered;
    Promise<Unit> next;
    {
      absl::MutexLock lock(&mu);
      if (answered == in_flight.size()) continue;  // the next batch is on its way
      next = std::move(in_flight[answered++]);
    }
    next.Set(Unit{});
  }
  std::vector<std::string> delivered;
  for (const auto& batch : batches) {
    size_t bytes = 0;
    for (const auto& item : batch) bytes += item.size();
    EXPECT_TRUE(batch.size() == 1 || bytes <= 1000) << batch.size() << " items, " << bytes << " bytes";
    delivered.insert(delivered.end(), batch.begin(), batch.end());
  }
  EXPECT_EQ(delivered, items);
  EXPECT_EQ(batches.size(), 5u);  // a | b c | z | d e | f
}

// A flush through item n waits for the batch holding n only, not for items pushed after it.
// The refused run of a scheduler that answers faster than its client asks: the batch fails
// between the item's Push and the flush the caller asks for next, and the flush still says so
// (it once answered OK, and a fetch then reported "no shard" instead of the refusal).
TEST(OrderedBatchQueueTest, AFlushAskedForAfterItsBatchFailedReportsTheFailure) {
  std::vector<int> handed_back;
  auto queue = std::make_shared<OrderedBatchQueue<int>>(
      [](std::vector<int> batch) {
        // Answered at once: item 2 is refused, the others accepted.
        if (batch.front() == 2) return Future<Unit>::Ready(absl::InvalidArgumentError("scheduling weight 100"));
        return Future<Unit>::Ready(Unit{});
      },
      [&](std::vector<int> items, const absl::Status&) { handed_back = items; });
  ASSERT_EQ(queue->Push(1), 1);
  EXPECT_TRUE(queue->Flushed().IsReady());
  ASSERT_EQ(queue->Push(2), 2);  // sent, refused and done before Flushed is asked for
  absl::StatusOr<Unit> refused = queue->FlushedThrough(2).AwaitFor(absl::Seconds(30));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_EQ(queue->Flushed().AwaitFor(absl::Seconds(30)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(handed_back, std::vector<int>{2});
  // Delivery goes on, and the items around the failed one flush fine.
  ASSERT_EQ(queue->Push(3), 3);
  EXPECT_TRUE(queue->Flushed().AwaitFor(absl::Seconds(30)).ok());
  EXPECT_TRUE(queue->FlushedThrough(1).AwaitFor(absl::Seconds(30)).ok());
}

TEST(OrderedBatchQueueTest, AFlushThroughAnItemIgnoresLaterItems) {
  absl::Mutex mu;
  std::vector<Promise<Unit>> in_flight;
  auto queue = std::make_shared<OrderedBatchQueue<int>>([&](std::vector<int>) {
    absl::MutexLock lock(&mu);
    in_flight.emplace_back();
    return in_flight.back().future();
  });
  const int64_t first = queue->Push(1);  // goes at once
  const int64_t second = queue->Push(2);  // waits for the first batch
  EXPECT_EQ(first, 1);
  EXPECT_EQ(second, 2);
  Future<Unit> all = queue->Flushed();  // asked before and after a flush through the first item
  Future<Unit> through_first = queue->FlushedThrough(first);
  Future<Unit> all_again = queue->Flushed();
  EXPECT_FALSE(through_first.IsReady());
  Promise<Unit> answer;
  {
    absl::MutexLock lock(&mu);
    answer = std::move(in_flight[0]);
  }
  answer.Set(Unit{});  // the second batch is sent now, and stays unanswered
  EXPECT_TRUE(through_first.AwaitFor(absl::Seconds(30)).ok());
  EXPECT_FALSE(all.IsReady());
  EXPECT_FALSE(all_again.IsReady());
  EXPECT_EQ(queue->acked(), 1);
  EXPECT_TRUE(queue->FlushedThrough(0).IsReady());
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(in_flight.size(), 2u);
    answer = std::move(in_flight[1]);
  }
  answer.Set(Unit{});
  EXPECT_TRUE(all.AwaitFor(absl::Seconds(30)).ok());
  EXPECT_TRUE(all_again.AwaitFor(absl::Seconds(30)).ok());
}

TEST(RpcUtilTest, StatusRoundTripsThroughGrpc) {
  absl::Status s = absl::ResourceExhaustedError("device full");
  EXPECT_EQ(FromGrpc(ToGrpc(s)), s);
  EXPECT_TRUE(FromGrpc(ToGrpc(absl::OkStatus())).ok());
  absl::Status wrapped = FromGrpc(ToGrpc(absl::UnavailableError("gone")), "Enqueue on worker h:1");
  EXPECT_EQ(wrapped.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(wrapped.message(), "Enqueue on worker h:1: gone");
}

// gRPC's own lines come out in the project's format and obey its level.
TEST(RpcUtilTest, GrpcsLogLinesGoThroughTheProjectsLog) {
  grpc_init();  // as making a channel or a server does: before it gRPC logs nothing
  ::testing::internal::CaptureStderr();
  gpr_log(GPR_ERROR, "something broke: %d", 42);
  const std::string line = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(std::regex_search(line, std::regex(R"(^E \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z transport_test\.cc:\d+\] grpc: something broke: 42\n$)")))
      << line;
  const LogLevel before = MinLogLevel();
  const gpr_log_severity grpc_before = gpr_should_log(GPR_LOG_SEVERITY_DEBUG)  ? GPR_LOG_SEVERITY_DEBUG
                                       : gpr_should_log(GPR_LOG_SEVERITY_INFO) ? GPR_LOG_SEVERITY_INFO
                                                                               : GPR_LOG_SEVERITY_ERROR;
  SetMinLogLevel(LogLevel::kError);
  gpr_set_log_verbosity(GPR_LOG_SEVERITY_DEBUG);  // gRPC lets it through; our level does not
  ::testing::internal::CaptureStderr();
  gpr_log(GPR_INFO, "chatter");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  gpr_set_log_verbosity(grpc_before);
  SetMinLogLevel(before);
  grpc_shutdown();
}

TEST(AuthTest, OnlyTokensGrpcCanCarryAreTaken) {
  EXPECT_TRUE(CheckTokenCanTravel("", "--token").ok());
  EXPECT_TRUE(CheckTokenCanTravel("s3cret ~!", "--token").ok());
  EXPECT_TRUE(CheckTokenCanTravel(std::string(kMaxStreamTokenBytes, 'x'), "--token").ok());
  for (const std::string& bad : {std::string("a\nb"), std::string("tab\t"), std::string("\x7f"), std::string("\xc3\xa9"),
                                 std::string(1, '\0'), std::string(kMaxStreamTokenBytes + 1, 'x')}) {
    absl::Status s = CheckTokenCanTravel(bad, "PATHWAYS_TOKEN");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("the token from PATHWAYS_TOKEN"), std::string::npos) << s;
    if (bad.size() > 1) {
      EXPECT_EQ(s.message().find(bad), std::string::npos) << "the token is echoed: " << s;
    }
  }
  absl::StatusOr<std::string> flag = TokenFromFlagOrEnv("a\nb");
  EXPECT_EQ(flag.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flag.status().message().find("--token"), std::string::npos) << flag.status();
  absl::StatusOr<std::string> cluster = ClusterTokenFromFlagOrEnv("\x01", "fine");
  EXPECT_NE(cluster.status().message().find("--cluster-token"), std::string::npos) << cluster.status();
  // From the environment (nothing else of this test binary reads these variables).
  ASSERT_EQ(setenv("PATHWAYS_TOKEN", "a\nb", 1), 0);
  ASSERT_EQ(setenv("PATHWAYS_CLUSTER_TOKEN", "c\rd", 1), 0);
  absl::StatusOr<std::string> env = TokenFromFlagOrEnv("");
  absl::StatusOr<std::string> cluster_env = ClusterTokenFromFlagOrEnv("", "fine");
  absl::StatusOr<std::string> flag_wins = TokenFromFlagOrEnv("good");
  unsetenv("PATHWAYS_TOKEN");
  unsetenv("PATHWAYS_CLUSTER_TOKEN");
  EXPECT_NE(env.status().message().find("the token from PATHWAYS_TOKEN"), std::string::npos) << env.status();
  EXPECT_NE(cluster_env.status().message().find("the token from PATHWAYS_CLUSTER_TOKEN"), std::string::npos)
      << cluster_env.status();
  ASSERT_TRUE(flag_wins.ok()) << flag_wins.status();
  EXPECT_EQ(*flag_wins, "good");
  absl::StatusOr<std::string> fallback = ClusterTokenFromFlagOrEnv("", "fine");
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ(*fallback, "fine");
}

TEST(RpcUtilTest, TensorSpecFromWireIsValidated) {
  EXPECT_EQ(*FromProto(ToProto(TensorSpec{DType::kI64, {3, 4}})), (TensorSpec{DType::kI64, {3, 4}}));
  rpc::TensorSpecProto bad_dtype;
  bad_dtype.set_dtype(99);
  EXPECT_EQ(FromProto(bad_dtype).status().code(), absl::StatusCode::kInvalidArgument);
  rpc::TensorSpecProto huge;
  huge.set_dtype(static_cast<int>(DType::kF32));
  huge.add_shape(int64_t{1} << 40);
  huge.add_shape(int64_t{1} << 20);
  EXPECT_EQ(FromProto(huge).status().code(), absl::StatusCode::kInvalidArgument);
  rpc::TensorSpecProto negative;
  negative.set_dtype(static_cast<int>(DType::kF32));
  negative.add_shape(-2);
  EXPECT_EQ(FromProto(negative).status().code(), absl::StatusCode::kInvalidArgument);
}

// A worker that only records the order of the ops it is sent, and can be told to refuse.
class RecordingWorker final : public rpc::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* Enqueue(grpc::CallbackServerContext* context, const rpc::EnqueueRequest* request,
                                    rpc::EnqueueResponse*) override {
    auto* reactor = context->DefaultReactor();
    absl::MutexLock lock(&mu_);
    ++batches_;
    for (const auto& op : request->ops()) order_.push_back(op.free().array_id());
    reactor->Finish(refuse_ ? grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "refused") : grpc::Status::OK);
    return reactor;
  }
  std::vector<int64_t> order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }
  int batches() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  void Refuse() {
    absl::MutexLock lock(&mu_);
    refuse_ = true;
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> order_ ABSL_GUARDED_BY(mu_);
  int batches_ ABSL_GUARDED_BY(mu_) = 0;
  bool refuse_ ABSL_GUARDED_BY(mu_) = false;
};

class HostOpQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override { server_->Shutdown(); }

  static rpc::Op Free(int64_t id) {
    rpc::Op op;
    op.mutable_free()->set_array_id(id);
    return op;
  }

  RecordingWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

TEST_F(HostOpQueueTest, DeliversInOrderInFewerBatchesThanOps) {
  auto queue = std::make_shared<HostOpQueue>(WorkerClientCache::Global().Get(address_), NewClientIdentity());
  constexpr int kOps = 500;
  for (int i = 0; i < kOps; ++i) queue->Push(Free(i));
  ASSERT_TRUE(queue->Flushed().AwaitFor(absl::Seconds(30)).ok());
  std::vector<int64_t> order = worker_.order();
  ASSERT_EQ(order.size(), static_cast<size_t>(kOps));
  for (int i = 0; i < kOps; ++i) EXPECT_EQ(order[i], i);
  EXPECT_LT(worker_.batches(), kOps);  // ops pushed while a batch was in flight went together
}

TEST_F(HostOpQueueTest, ARefusedBatchFailsEveryLaterFlush) {
  auto queue = std::make_shared<HostOpQueue>(WorkerClientCache::Global().Get(address_), NewClientIdentity());
  worker_.Refuse();
  queue->Push(Free(1));
  absl::StatusOr<Unit> first = queue->Flushed().AwaitFor(absl::Seconds(30));
  EXPECT_EQ(first.status().code(), absl::StatusCode::kInvalidArgument) << first.status();
  queue->Push(Free(2));
  EXPECT_EQ(queue->Flushed().AwaitFor(absl::Seconds(30)).status().code(), absl::StatusCode::kInvalidArgument);
}

// A number reserved for an op the queue sends later (a put whose bytes go ahead over a data
// stream) holds Flushed() until the op is filled in and accepted, and a refusal of it reaches
// whoever waits: a fetch waiting on the host for that number would otherwise wait for good.
TEST_F(HostOpQueueTest, AFlushWaitsForNumbersReservedForFillingAndReportsTheirRefusal) {
  auto queue = std::make_shared<HostOpQueue>(WorkerClientCache::Global().Get(address_), NewClientIdentity());
  queue->Push(Free(1));
  const int64_t reserved = queue->ReserveForFill();
  Future<Unit> flushed = queue->Flushed();
  EXPECT_FALSE(flushed.AwaitFor(absl::Milliseconds(300)).ok());  // not before the fill
  queue->FillReserved(reserved, Free(2));
  ASSERT_TRUE(flushed.AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(worker_.order(), (std::vector<int64_t>{1, 2}));
  const int64_t refused = queue->ReserveForFill();
  Future<Unit> after = queue->Flushed();
  worker_.Refuse();
  queue->FillReserved(refused, Free(3));
  EXPECT_EQ(after.AwaitFor(absl::Seconds(30)).status().code(), absl::StatusCode::kInvalidArgument);
}

// A fetch of an op's results waits for that op and those numbered before it, not for ops pushed
// after it: a loop's frees would otherwise add their delivery to every round trip.
TEST_F(HostOpQueueTest, AFlushThroughANumberWaitsOnlyForOpsUpToIt) {
  auto queue = std::make_shared<HostOpQueue>(WorkerClientCache::Global().Get(address_), NewClientIdentity());
  const int64_t first = queue->Push(Free(1));
  const int64_t reserved = queue->ReserveForFill();
  const int64_t later = queue->Push(Free(3));
  ASSERT_TRUE(queue->FlushedThrough(first).AwaitFor(absl::Seconds(30)).ok());
  Future<Unit> through_reserved = queue->FlushedThrough(reserved);
  Future<Unit> through_later = queue->FlushedThrough(later);
  EXPECT_FALSE(through_reserved.AwaitFor(absl::Milliseconds(300)).ok());  // not before the fill
  EXPECT_FALSE(through_later.IsReady());
  queue->FillReserved(reserved, Free(2));
  EXPECT_TRUE(through_reserved.AwaitFor(absl::Seconds(30)).ok());
  EXPECT_TRUE(through_later.AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(worker_.order(), (std::vector<int64_t>{1, 3, 2}));  // hosts order them by number
}

TEST(HostOpQueueUnreachableTest, AMissingHostIsReportedNotAwaitedForever) {
  // Port 1 on loopback: nothing listens there.
  auto queue = std::make_shared<HostOpQueue>(WorkerClientCache::Global().Get("127.0.0.1:1"), NewClientIdentity());
  rpc::Op op;
  op.mutable_free()->set_array_id(1);
  queue->Push(op);
  absl::StatusOr<Unit> flushed = queue->Flushed().AwaitFor(absl::Seconds(60));
  EXPECT_EQ(flushed.status().code(), absl::StatusCode::kUnavailable) << flushed.status();
  EXPECT_NE(flushed.status().message().find("127.0.0.1:1"), std::string::npos) << flushed.status();
}

}  // namespace
}  // namespace pathways
