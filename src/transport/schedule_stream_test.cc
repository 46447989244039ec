#include "transport/schedule_stream.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "core/socket_util.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

// A controller's side whose answers the test gives: each request's promise waits in `pending`.
struct Controller {
  absl::Mutex mu;
  std::vector<std::pair<std::string, Promise<Unit>>> pending ABSL_GUARDED_BY(mu);  // client id, answer
  std::unique_ptr<StreamListener> listener;

  explicit Controller(const std::string& token = "") {
    auto l = StreamListener::Start("test controller", "127.0.0.1", 0,
                                   {{std::string(kScheduleStreamMagic, 8), token, "",
                                     [this](int fd, const StreamListener& listener, const std::string&) {
                                       ServeScheduleStream(fd, listener, [this](const rpc::ScheduleRequest& r) {
                                         absl::MutexLock lock(&mu);
                                         pending.emplace_back(r.client_id(), Promise<Unit>());
                                         return pending.back().second.future();
                                       });
                                     }}});
    EXPECT_TRUE(l.ok()) << l.status();
    if (l.ok()) listener = *std::move(l);
  }
  bool WaitForRequests(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return pending.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  }
  void Answer(size_t i, absl::Status status) {
    absl::MutexLock lock(&mu);
    if (status.ok()) {
      pending[i].second.Set(Unit{});
    } else {
      pending[i].second.Set(status);
    }
  }
};

rpc::ScheduleRequest Request(const std::string& client) {
  rpc::ScheduleRequest r;
  r.set_client_id(client);
  return r;
}

TEST(ScheduleStreamTest, AnswersComeInTheRequestsOrderWithTheirStatus) {
  Controller controller;
  auto stream = ScheduleStream::Connect("c:1", "127.0.0.1", controller.listener->port(), absl::Seconds(5));
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<Future<Unit>> answers;
  for (int i = 0; i < 3; ++i) answers.push_back((*stream)->Schedule(Request(absl::StrCat("client", i))));
  ASSERT_TRUE(controller.WaitForRequests(3));
  {
    absl::MutexLock lock(&controller.mu);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(controller.pending[i].first, absl::StrCat("client", i));
  }
  // The last is ready first: it is answered after the others all the same.
  controller.Answer(2, absl::OkStatus());
  controller.Answer(1, absl::InvalidArgumentError("weight 7 is not in [0, 4]"));
  EXPECT_FALSE(answers[2].WaitFor(absl::Milliseconds(50)));
  controller.Answer(0, absl::OkStatus());
  EXPECT_TRUE(answers[0].Await().ok());
  const absl::Status refused = answers[1].Await().status();
  EXPECT_TRUE(absl::IsInvalidArgument(refused));
  EXPECT_EQ(refused.message(), "Schedule on controller c:1: weight 7 is not in [0, 4]");
  EXPECT_TRUE(answers[2].Await().ok());
  EXPECT_FALSE((*stream)->broken());
}

TEST(ScheduleStreamTest, AWrongTokenIsRefusedAtConnect) {
  Controller controller("secret");
  auto stream = ScheduleStream::Connect("c:1", "127.0.0.1", controller.listener->port(), absl::Seconds(5));
  ASSERT_FALSE(stream.ok());
  EXPECT_TRUE(absl::IsUnauthenticated(stream.status())) << stream.status();
}

TEST(ScheduleStreamTest, AControllerThatGoesFailsWhatWaitsAndTheStreamSaysBroken) {
  auto controller = std::make_unique<Controller>();
  auto stream = ScheduleStream::Connect("c:1", "127.0.0.1", controller->listener->port(), absl::Seconds(5));
  ASSERT_TRUE(stream.ok()) << stream.status();
  Future<Unit> waiting = (*stream)->Schedule(Request("a"));
  ASSERT_TRUE(controller->WaitForRequests(1));
  controller->listener.reset();  // closes the connection: the request's answer never comes
  const absl::Status failed = waiting.Await().status();
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_NE(failed.message().find("controller c:1"), std::string::npos) << failed;
  EXPECT_TRUE((*stream)->broken());
  EXPECT_FALSE((*stream)->Schedule(Request("b")).Await().ok());  // at once
}

TEST(ScheduleStreamTest, ARequestThatDoesNotParseIsRefusedAndTheStreamGoesOn) {
  Controller controller;
  auto fd = DialStream("test", "127.0.0.1", controller.listener->port(), kScheduleStreamMagic, "", absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(ReadStreamHeader(*fd, absl::Seconds(5), "test").ok());
  const std::string good = Request("a").SerializeAsString();
  std::string bytes = absl::StrCat(EncodeStreamU32(3), "\xff\xff\xff", EncodeStreamU32(good.size()), good);
  ASSERT_TRUE(TransferAll(*fd, bytes.data(), bytes.size(), true, absl::Now() + absl::Seconds(5), "test").ok());
  auto refused = ReadStreamHeader(*fd, absl::Seconds(10), "test");
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_TRUE(absl::IsInvalidArgument(HeaderStatus(*refused))) << refused->message();
  ASSERT_TRUE(controller.WaitForRequests(1));
  controller.Answer(0, absl::OkStatus());
  auto answered = ReadStreamHeader(*fd, absl::Seconds(10), "test");
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_TRUE(HeaderStatus(*answered).ok());
  // A length past the bound: refused, and the connection closes.
  bytes = EncodeStreamU32(kMaxScheduleRequestBytes + 1);
  ASSERT_TRUE(TransferAll(*fd, bytes.data(), bytes.size(), true, absl::Now() + absl::Seconds(5), "test").ok());
  auto too_long = ReadStreamHeader(*fd, absl::Seconds(10), "test");
  ASSERT_TRUE(too_long.ok()) << too_long.status();
  EXPECT_TRUE(absl::IsInvalidArgument(HeaderStatus(*too_long)));
  char c;
  EXPECT_FALSE(TransferAll(*fd, &c, 1, false, absl::Now() + absl::Seconds(10), "test").ok());
  close(*fd);
}

}  // namespace
}  // namespace pathways
