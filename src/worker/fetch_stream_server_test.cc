#include "worker/fetch_stream_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/socket_util.h"
#include "device/cpu_device.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"
#include "transport/auth.h"
#include "transport/fetch_stream.h"

namespace pathways {
namespace {

// Quick keepalives and a short silence bound, so the tests see both in well under a second.
FetchStreamTiming Quick() { return {absl::Milliseconds(20), absl::Milliseconds(400), absl::Seconds(2)}; }

struct Fixture {
  CpuDevice device{0, 64 << 20};
  ClientIdentity client = NewClientIdentity();
  BufferPtr buffer;
  // What the server answers with; the test may replace it.
  std::function<Future<std::vector<BufferPtr>>(const rpc::FetchRequest&)> answer;
  std::unique_ptr<FetchStreamServer> server;

  explicit Fixture(std::string token = "") {
    buffer = *device.Allocate(DType::kF32, {1 << 20});
    float* f = reinterpret_cast<float*>(buffer->data());
    for (int i = 0; i < (1 << 20); ++i) f[i] = static_cast<float>(i);
    answer = [this](const rpc::FetchRequest&) { return Future<std::vector<BufferPtr>>::Ready(std::vector{buffer}); };
    server = *FetchStreamServer::Start(
        "127.0.0.1", token, "", [this](const rpc::FetchRequest& r) { return answer(r); }, Quick());
  }
  rpc::FetchRequest Request(bool status_only = false) const {
    rpc::FetchRequest r;
    r.set_client_id(client.id);
    r.set_credential(client.credential);
    r.set_array_id(1);
    r.add_shards(0);
    r.set_status_only(status_only);
    return r;
  }
};

TEST(FetchStreamTest, ShardsArriveWhole) {
  Fixture f;
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  for (int i = 0; i < 3; ++i) {  // the connection is reused
    auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ((*got)->shards_size(), 1);
    const std::string& data = (*got)->shards(0).data();
    ASSERT_EQ(data.size(), size_t{4} << 20);
    EXPECT_EQ(std::memcmp(data.data(), f.buffer->data(), data.size()), 0);
  }
  auto status = client.Fetch(f.Request(/*status_only=*/true), 4 << 20)->AwaitFor(absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ((*status)->shards_size(), 0);
  EXPECT_EQ(f.server->answered(), 4);
}

TEST(FetchStreamTest, ErrorsComeWithTheirCodeAndTheStreamGoesOn) {
  Fixture f;
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  f.answer = [](const rpc::FetchRequest&) {
    return Future<std::vector<BufferPtr>>::Ready(absl::NotFoundError("no shard 0 of array 1"));
  };
  auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got.status().message(), "Fetch on worker worker-a: no shard 0 of array 1");
  // Another client's credential is refused; so is a response larger than the array.
  rpc::FetchRequest forged = f.Request();
  forged.set_credential(NewClientIdentity().credential);
  f.answer = [&](const rpc::FetchRequest&) { return Future<std::vector<BufferPtr>>::Ready(std::vector{f.buffer}); };
  EXPECT_EQ(client.Fetch(forged, 4 << 20)->AwaitFor(absl::Seconds(30)).status().code(),
            absl::StatusCode::kUnauthenticated);
  auto too_large = client.Fetch(f.Request(), 1024)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(too_large.status().code(), absl::StatusCode::kDataLoss) << too_large.status();
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
}

TEST(FetchStreamTest, AWaitingFetchHearsKeepalivesAndASilentWorkerIsNamed) {
  Fixture f;
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  // The data comes after many keepalive intervals and more than the silence bound: the fetch waits.
  Promise<std::vector<BufferPtr>> later;
  f.answer = [&](const rpc::FetchRequest&) { return later.future(); };
  auto waiting = *client.Fetch(f.Request(), 4 << 20);
  EXPECT_FALSE(waiting.AwaitFor(absl::Milliseconds(900)).ok());  // still waiting, past the silence bound
  later.Set(std::vector{f.buffer});
  EXPECT_TRUE(waiting.AwaitFor(absl::Seconds(30)).ok());
  // A listener that accepts and never answers (a frozen worker): the fetch fails naming it.
  int port = 0;
  const int silent = testing::ListenLoopback(&port);
  ASSERT_GE(silent, 0);
  FetchStreamClient to_frozen("worker-frozen", "127.0.0.1", port, Quick());
  auto frozen = to_frozen.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(frozen.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(frozen.status().message().find("worker-frozen"), std::string::npos) << frozen.status();
  EXPECT_NE(frozen.status().message().find("frozen"), std::string::npos) << frozen.status();
  close(silent);
}

TEST(FetchStreamTest, AWrongTokenIsRefusedAndGarbageClosesOnlyItsConnection) {
  Fixture f("secret");
  SetCallToken("not-the-secret");
  {
    FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
    auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnauthenticated) << got.status();
  }
  // Garbage, and a request length beyond the bound, from raw connections: each is closed.
  for (const std::string& bytes : {std::string("GET / HTTP/1.1\r\n\r\n"),
                                   absl::StrCat(std::string(kFetchStreamMagic, 8), EncodeFetchU32(6), "secret",
                                                EncodeFetchU32(kMaxFetchRequestBytes + 1))}) {
    const int fd = testing::DialLoopback(f.server->port());
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
    char sink[256];
    pollfd p{fd, POLLIN, 0};
    ssize_t n = 1;
    while (n > 0 && poll(&p, 1, 5000) == 1) n = recv(fd, sink, sizeof(sink), 0);
    // Closed: an end of stream, or a reset when the server left bytes unread.
    EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << "the server should close the connection";
    close(fd);
  }
  SetCallToken("secret");
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  SetCallToken("");
}

TEST(FetchStreamTest, AServerThatStopsFailsTheFetchesInFlight) {
  Fixture f;
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  Promise<std::vector<BufferPtr>> never;
  f.answer = [&](const rpc::FetchRequest&) { return never.future(); };
  auto waiting = *client.Fetch(f.Request(), 4 << 20);
  f.server.reset();  // while the fetch waits
  auto got = waiting.AwaitFor(absl::Seconds(30));
  EXPECT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("worker-a"), std::string::npos) << got.status();
  never.Set(absl::CancelledError("test over"));
  // A stream that cannot be dialed says so: the caller may send the fetch another way.
  auto refused = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(FetchStreamClient::WhyNotSent(refused.status()), FetchStreamClient::NotSentReason::kUnreachable)
      << refused.status();
}

// A kept connection that the worker closed meanwhile (a restart at the same port, its idle
// bound) is dialed afresh instead of failing the next fetch.
TEST(FetchStreamTest, AConnectionTheWorkerClosedIsDialedAgain) {
  Fixture f;
  FetchStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  ASSERT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  const int port = f.server->port();
  f.server.reset();
  auto again = FetchStreamServer::Start(
      "127.0.0.1", "", "", [&](const rpc::FetchRequest& r) { return f.answer(r); }, Quick(), port);
  ASSERT_TRUE(again.ok()) << again.status();
  auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*again)->answered(), 1);
}

}  // namespace
}  // namespace pathways
