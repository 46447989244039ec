#include "worker/data_stream_server.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/socket_util.h"
#include "core/status_macros.h"
#include "device/cpu_device.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"
#include "transport/auth.h"
#include "transport/data_stream.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// Quick keepalives and a short silence bound, so the tests see both in well under a second.
// Staged bytes at 64 KiB/s at least: a stage of 16 KiB elements (64 KiB) has 1.4 s.
DataStreamTiming Quick() { return {absl::Milliseconds(20), absl::Milliseconds(400), absl::Seconds(2), 64 << 10}; }

struct Fixture {
  CpuDevice device{0, 64 << 20};
  ClientIdentity client = NewClientIdentity();
  BufferPtr buffer;
  // What the server answers with; the test may replace it.
  std::function<Future<std::vector<BufferPtr>>(const rpc::FetchRequest&)> answer;
  // Staged bytes land on `device` unless `refuse_landing` says why not; what was kept, by array id.
  absl::Status refuse_landing;
  absl::Status refuse_tenant;  // every request's tenant is refused with it, unless OK
  absl::Mutex mu;
  std::map<int64_t, BufferPtr> kept ABSL_GUARDED_BY(mu);
  std::vector<int64_t> freed ABSL_GUARDED_BY(mu);  // the array ids of the frees enqueued, in order
  std::unique_ptr<DataStreamServer> server;

  explicit Fixture(std::string token = "", int max_connections = DataStreamServer::kMaxConnections)
      : max_connections(max_connections) {
    buffer = *device.Allocate(DType::kF32, {1 << 20});
    float* f = reinterpret_cast<float*>(buffer->data());
    for (int i = 0; i < (1 << 20); ++i) f[i] = static_cast<float>(i);
    answer = [this](const rpc::FetchRequest&) { return Future<std::vector<BufferPtr>>::Ready(std::vector{buffer}); };
    server = *Start(token);
  }
  const int max_connections;
  absl::StatusOr<std::unique_ptr<DataStreamServer>> Start(const std::string& token = "", int port = 0) {
    DataStreamServer::Handlers handlers{
        .fetch = [this](const rpc::FetchRequest& r) { return answer(r); },
        .land = [this](const rpc::StageRequest& r) -> absl::StatusOr<BufferPtr> {
          if (!refuse_landing.ok()) return refuse_landing;
          PW_ASSIGN_OR_RETURN(TensorSpec spec, FromProto(r.spec()));
          return device.Allocate(spec.dtype, spec.shape);
        },
        .keep = [this](const rpc::StageRequest& r, BufferPtr b) {
          absl::MutexLock lock(&mu);
          kept[r.dest().array_id()] = std::move(b);
          return absl::OkStatus();
        },
        .enqueue = [this](const rpc::EnqueueRequest& r) {
          absl::MutexLock lock(&mu);
          for (const rpc::Op& op : r.ops()) {
            if (!op.has_free()) return absl::InvalidArgumentError("only frees here");
            freed.push_back(op.free().array_id());
          }
          return absl::OkStatus();
        },
        .refused = [this](const std::string&) { return refuse_tenant; }};
    return DataStreamServer::Start("127.0.0.1", token, "", std::move(handlers), Quick(), port, max_connections);
  }
  BufferPtr Kept(int64_t array_id) {
    absl::MutexLock lock(&mu);
    auto it = kept.find(array_id);
    return it == kept.end() ? nullptr : it->second;
  }
  rpc::StageRequest Stage(int64_t array_id, int64_t elements) const {
    rpc::StageRequest r;
    r.set_client_id(client.id);
    r.set_credential(client.credential);
    r.mutable_dest()->set_array_id(array_id);
    *r.mutable_spec() = ToProto(TensorSpec{DType::kF32, {elements}});
    return r;
  }
  std::vector<int64_t> Freed() {
    absl::MutexLock lock(&mu);
    return freed;
  }
  rpc::EnqueueRequest Frees(std::vector<int64_t> ids) const {
    rpc::EnqueueRequest r;
    r.set_client_id(client.id);
    r.set_credential(client.credential);
    for (int64_t id : ids) r.add_ops()->mutable_free()->set_array_id(id);
    return r;
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

TEST(DataStreamTest, ShardsArriveWhole) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
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

// A connection idle past the client's bound ends with its thread; the next fetch dials anew.
TEST(DataStreamTest, AnIdleConnectionEndsWithItsThreadAndTheNextFetchDialsAgain) {
  Fixture f;
  DataStreamTiming timing = Quick();
  timing.client_idle = absl::Milliseconds(100);
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), timing);
  for (int round = 0; round < 2; ++round) {
    auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((*got)->shards(0).data().size(), size_t{4} << 20);
    ASSERT_TRUE(client.WaitForConnectionsAtMost(0, absl::Seconds(30))) << "round " << round;
  }
  EXPECT_EQ(f.server->answered(), 2);
}

TEST(DataStreamTest, ErrorsComeWithTheirCodeAndTheStreamGoesOn) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
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

TEST(DataStreamTest, AWaitingFetchHearsKeepalivesAndASilentWorkerIsNamed) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
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
  DataStreamClient to_frozen("worker-frozen", "127.0.0.1", port, Quick());
  auto frozen = to_frozen.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(frozen.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(frozen.status().message().find("worker-frozen"), std::string::npos) << frozen.status();
  EXPECT_NE(frozen.status().message().find("frozen"), std::string::npos) << frozen.status();
  close(silent);
}

TEST(DataStreamTest, AWrongTokenIsRefusedAndGarbageClosesOnlyItsConnection) {
  Fixture f("secret");
  SetCallToken("not-the-secret");
  {
    DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
    auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnauthenticated) << got.status();
  }
  // Garbage, and a request length beyond the bound, from raw connections: each is closed.
  for (const std::string& bytes : {std::string("GET / HTTP/1.1\r\n\r\n"),
                                   absl::StrCat(std::string(kDataStreamMagic, 8), EncodeStreamU32(6), "secret",
                                                EncodeStreamU32(kMaxStreamRequestBytes + 1))}) {
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
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  SetCallToken("");
}

TEST(DataStreamTest, AServerThatStopsFailsTheFetchesInFlight) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
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
  EXPECT_EQ(DataStreamClient::WhyNotSent(refused.status()), DataStreamClient::NotSentReason::kUnreachable)
      << refused.status();
}

// A kept connection that the worker closed meanwhile (a restart at the same port, its idle
// bound) is dialed afresh instead of failing the next fetch.
TEST(DataStreamTest, AConnectionTheWorkerClosedIsDialedAgain) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  ASSERT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  const int port = f.server->port();
  f.server.reset();
  auto again = f.Start("", port);
  ASSERT_TRUE(again.ok()) << again.status();
  auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*again)->answered(), 1);
}

// Connections that never say hello wait without a thread: more of them than the server serves
// at once do not keep a client out, and each is closed once the connect bound passes.
TEST(DataStreamTest, SilentConnectionsTakeNoThreadAndDoNotKeepClientsOut) {
  Fixture f("", /*max_connections=*/4);
  std::vector<int> silent;
  for (int i = 0; i < 20; ++i) {
    const int fd = testing::DialLoopback(f.server->port());
    ASSERT_GE(fd, 0) << std::strerror(errno);
    silent.push_back(fd);
  }
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  auto got = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_TRUE(got.ok()) << got.status();
  for (int fd : silent) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 10000), 1) << "a silent connection should be closed after the connect bound";
    char c;
    EXPECT_LE(recv(fd, &c, 1, 0), 0);
    close(fd);
  }
}

// A put's bytes go ahead into a device buffer the worker keeps; the connection then serves
// fetches as before.
TEST(DataStreamTest, StagedBytesLandInADeviceBufferAndAreKept) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  auto bytes = std::make_shared<std::string>(std::string(f.buffer->data(), 4 << 20));
  for (int64_t id : {7, 8}) {  // the second on the same connection
    auto staged = client.Stage(f.Stage(id, 1 << 20), bytes)->AwaitFor(absl::Seconds(30));
    ASSERT_TRUE(staged.ok()) << staged.status();
    BufferPtr kept = f.Kept(id);
    ASSERT_NE(kept, nullptr);
    EXPECT_EQ(std::memcmp(kept->data(), bytes->data(), bytes->size()), 0);
  }
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(f.server->answered(), 3);
}

// A stage request the worker cannot take (no memory, another client's credential) fails with
// the reason or a closed connection, keeps nothing, and the next request dials again.
TEST(DataStreamTest, ARefusedStageKeepsNothingAndTheStreamServesOn) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  auto bytes = std::make_shared<std::string>(1 << 20, 'x');
  f.refuse_landing = absl::ResourceExhaustedError("device 0 is full");
  EXPECT_FALSE(client.Stage(f.Stage(1, 1 << 18), bytes)->AwaitFor(absl::Seconds(30)).ok());
  f.refuse_landing = absl::OkStatus();
  rpc::StageRequest forged = f.Stage(2, 1 << 18);
  forged.set_credential(NewClientIdentity().credential);
  EXPECT_FALSE(client.Stage(forged, bytes)->AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(f.Kept(1), nullptr);
  EXPECT_EQ(f.Kept(2), nullptr);
  EXPECT_TRUE(client.Stage(f.Stage(3, 1 << 18), bytes)->AwaitFor(absl::Seconds(30)).ok());
  EXPECT_NE(f.Kept(3), nullptr);
}

// A client's ops reach the worker in order over the stream; ops the worker refuses, or another
// client's credential, come back as errors with the worker named, and the stream serves on. A
// request over the stream's bound is not sent (the caller uses gRPC).
TEST(DataStreamTest, OpsAreTakenInOrderAndRefusalsComeBack) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  for (int64_t i = 1; i <= 3; ++i) {
    auto taken = client.Enqueue(f.Frees({2 * i, 2 * i + 1}))->AwaitFor(absl::Seconds(30));
    ASSERT_TRUE(taken.ok()) << taken.status();
  }
  EXPECT_EQ(f.Freed(), (std::vector<int64_t>{2, 3, 4, 5, 6, 7}));
  rpc::EnqueueRequest refused = f.Frees({});
  refused.add_ops()->mutable_put();
  auto bad = client.Enqueue(refused)->AwaitFor(absl::Seconds(30));
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_NE(bad.status().message().find("Enqueue on worker worker-a: only frees here"), std::string::npos)
      << bad.status();
  rpc::EnqueueRequest forged = f.Frees({9});
  forged.set_credential(NewClientIdentity().credential);
  EXPECT_FALSE(client.Enqueue(forged)->AwaitFor(absl::Seconds(30)).ok());
  rpc::EnqueueRequest large = f.Frees({});
  large.add_ops()->mutable_put()->set_data(std::string(kMaxStreamRequestBytes, 'x'));
  EXPECT_FALSE(client.Enqueue(large).has_value());
  EXPECT_TRUE(client.Enqueue(f.Frees({10}))->AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(f.Freed(), (std::vector<int64_t>{2, 3, 4, 5, 6, 7, 10}));
}

// A worker that reads a request and hangs up before answering (it was stopping, say) may have
// taken an enqueue's ops: that one fails as sent, so nothing sends the batch again (another way
// would apply it twice), while a fetch cut off the same way is one gRPC may try.
TEST(DataStreamTest, AnEnqueueCutOffAfterItWentOutIsNotSentAgain) {
  int port = 0;
  const int listener = testing::ListenLoopback(&port);
  ASSERT_GE(listener, 0) << std::strerror(errno);
  std::thread hang_up([listener] {
    for (int i = 0; i < 2; ++i) {
      const int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      char taken[256];
      (void)recv(fd, taken, sizeof taken, 0);  // the hello and the request, or part of them
      close(fd);
    }
  });
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", port, Quick());
  auto cut = client.Enqueue(f.Frees({1}))->AwaitFor(absl::Seconds(30));
  EXPECT_FALSE(cut.ok());
  EXPECT_EQ(DataStreamClient::WhyNotSent(cut.status()), DataStreamClient::NotSentReason::kSent) << cut.status();
  auto fetch = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_FALSE(fetch.ok());
  EXPECT_EQ(DataStreamClient::WhyNotSent(fetch.status()), DataStreamClient::NotSentReason::kBusy) << fetch.status();
  hang_up.join();
  close(listener);
}

// A client that stops halfway through a stage's bytes (it died, or lied about the size) leaves
// nothing kept; one that sends a request of no kind is refused.
TEST(DataStreamTest, BytesThatStopHalfwayAreNotKept) {
  Fixture f;
  rpc::StreamRequest request;
  *request.mutable_stage() = f.Stage(5, 1 << 18);
  const std::string body = request.SerializeAsString();
  const std::string hello = absl::StrCat(std::string(kDataStreamMagic, 8), EncodeStreamU32(0));
  for (const std::string& sent : {absl::StrCat(hello, EncodeStreamU32(body.size()), body, std::string(1000, 'x')),
                                  absl::StrCat(hello, EncodeStreamU32(0))}) {
    const int fd = testing::DialLoopback(f.server->port());
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(send(fd, sent.data(), sent.size(), MSG_NOSIGNAL), static_cast<ssize_t>(sent.size()));
    if (sent.size() > 100) {
      close(fd);  // halfway through the bytes
      continue;
    }
    char kind = 0;
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 5000), 1);
    ASSERT_EQ(recv(fd, &kind, 1, 0), 1);
    EXPECT_EQ(kind, kStreamHeader);  // the refusal of a request of no kind
    close(fd);
  }
  // The server is still there, and kept nothing of the cut-off stage.
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  EXPECT_EQ(f.Kept(5), nullptr);
}

// A client trickling a stage's bytes, never so slowly that the silence bound fires, is cut off at
// the minimum average speed: the stream's thread and the landing buffer are not its to keep.
TEST(DataStreamTest, AStageTrickledBelowTheMinimumSpeedIsCutOffAndNothingKept) {
  Fixture f;
  const int64_t before = f.device.stats().memory_used;
  rpc::StreamRequest request;
  *request.mutable_stage() = f.Stage(6, 16 << 10);
  const std::string body = request.SerializeAsString();
  const std::string sent = absl::StrCat(std::string(kDataStreamMagic, 8), EncodeStreamU32(0),
                                        EncodeStreamU32(body.size()), body);
  const int fd = testing::DialLoopback(f.server->port());
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(send(fd, sent.data(), sent.size(), MSG_NOSIGNAL), static_cast<ssize_t>(sent.size()));
  bool cut = false;
  for (int i = 0; i < 400 && !cut; ++i) {  // a byte every 50 ms (the silence bound is 400 ms), 20 s at most
    if (send(fd, "x", 1, MSG_NOSIGNAL) != 1) break;
    pollfd p{fd, POLLIN, 0};
    cut = poll(&p, 1, 50) > 0;  // the server closed it (or answered, which it does only when done)
  }
  close(fd);
  EXPECT_TRUE(cut) << "a stage at 20 bytes/s was read for 20 s";
  EXPECT_EQ(f.Kept(6), nullptr);
  EXPECT_TRUE(f.device.WaitForMemoryUsedAtMost(before, absl::Seconds(10)));
}

// A tenant the controller refuses since its connection opened: each request is refused with the
// reason (and the connection closes); once let in again, it is served.
TEST(DataStreamTest, ARefusedTenantsRequestsAreRefused) {
  Fixture f;
  DataStreamClient client("worker-a", "127.0.0.1", f.server->port(), Quick());
  ASSERT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
  f.refuse_tenant = absl::FailedPreconditionError("this cluster refuses tenant mallory");
  auto refused = client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("refuses tenant mallory"), std::string::npos) << refused.status();
  f.refuse_tenant = absl::OkStatus();
  EXPECT_TRUE(client.Fetch(f.Request(), 4 << 20)->AwaitFor(absl::Seconds(30)).ok());
}

}  // namespace
}  // namespace pathways
