#include "dataflow/stream_peer.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/socket_util.h"
#include "gtest/gtest.h"

namespace pathways::dataflow {
namespace {

// A receiver: a listener whose dataflow streams hand batches to a list.
struct Receiver {
  absl::Mutex mu;
  std::vector<std::pair<std::string, Envelope>> got ABSL_GUARDED_BY(mu);
  std::unique_ptr<StreamListener> listener;

  absl::Status Start(int port = 0, absl::Duration frame_silence = absl::Seconds(30)) {
    StreamListener::Protocol protocol =
        DataflowStreamProtocol("", [this](const std::string&, const std::string& graph, std::vector<Envelope> batch) {
          absl::MutexLock lock(&mu);
          for (Envelope& e : batch) got.emplace_back(graph, std::move(e));
        });
    protocol.frame_silence = frame_silence;
    auto l = StreamListener::Start("test streams", "127.0.0.1", port, {std::move(protocol)});
    if (!l.ok()) return l.status();
    listener = *std::move(l);
    return absl::OkStatus();
  }
  bool WaitFor(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return got.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
  size_t size() {
    absl::MutexLock lock(&mu);
    return got.size();
  }
};

Envelope Numbered(int64_t i, size_t payload_bytes) {
  return {i, 1, 0, 0, false, 0, std::string(payload_bytes, static_cast<char>('a' + i % 26))};
}

// Connects a peer to `port` and waits for its verdict.
std::unique_ptr<StreamPeer> Connected(int port, absl::Status* verdict) {
  auto done = std::make_shared<absl::Notification>();
  auto status = std::make_shared<absl::Status>();
  auto peer = std::make_unique<StreamPeer>("me", "the receiver", "127.0.0.1", port, [done, status](const absl::Status& s) {
    *status = s;
    done->Notify();
  });
  done->WaitForNotification();
  *verdict = *status;
  return peer;
}

// A peer connected to `port`; null, with the test failed, when it could not connect.
std::unique_ptr<StreamPeer> ConnectedOk(int port) {
  absl::Status verdict;
  auto peer = Connected(port, &verdict);
  if (verdict.ok()) return peer;
  ADD_FAILURE() << verdict;
  return nullptr;
}

TEST(StreamPeerTest, BatchesArriveWholeAndInOrder) {
  Receiver r;
  ASSERT_TRUE(r.Start().ok());
  auto peer = ConnectedOk(r.listener->port());
  ASSERT_NE(peer, nullptr);
  // Small batches written by the sender's own thread, and large ones the socket cannot take at
  // once (left to the peer's thread), interleaved: the order holds across both ways.
  constexpr int kBatches = 400;
  for (int i = 0; i < kBatches; ++i) {
    const size_t bytes = i % 50 == 7 ? (size_t{4} << 20) : static_cast<size_t>(i % 100);
    peer->Enqueue(i % 2 == 0 ? "even" : "odd", {Numbered(i, bytes)});
  }
  ASSERT_TRUE(r.WaitFor(kBatches)) << r.size();
  absl::MutexLock lock(&r.mu);
  ASSERT_EQ(r.got.size(), static_cast<size_t>(kBatches));
  for (int i = 0; i < kBatches; ++i) {
    const auto& [graph, e] = r.got[i];
    EXPECT_EQ(graph, i % 2 == 0 ? "even" : "odd");
    ASSERT_EQ(e.epoch, i);
    const size_t bytes = i % 50 == 7 ? (size_t{4} << 20) : static_cast<size_t>(i % 100);
    EXPECT_EQ(e.payload, std::string(bytes, static_cast<char>('a' + i % 26)));
  }
  // The sender counts a batch once its write returned, which may be after the receiver has it.
  EXPECT_TRUE(peer->WaitUntilWritten(kBatches, absl::Seconds(30)));
  EXPECT_EQ(peer->written(), kBatches);
}

TEST(StreamPeerTest, NoListenerIsReportedAndNothingIsTaken) {
  // A port just freed: nothing listens there.
  int port = 0;
  {
    Receiver r;
    ASSERT_TRUE(r.Start().ok());
    port = r.listener->port();
  }
  absl::Status verdict;
  auto peer = Connected(port, &verdict);
  EXPECT_TRUE(absl::IsUnavailable(verdict)) << verdict;
  EXPECT_NE(verdict.message().find("dataflow stream to the receiver"), std::string::npos) << verdict;
}

TEST(StreamPeerTest, AReceiverThatRestartsGetsWhatIsSentAfter) {
  Receiver first;
  ASSERT_TRUE(first.Start().ok());
  const int port = first.listener->port();
  auto peer = ConnectedOk(port);
  ASSERT_NE(peer, nullptr);
  for (int i = 0; i < 10; ++i) peer->Enqueue("g", {Numbered(i, 10)});
  ASSERT_TRUE(first.WaitFor(10));
  first.listener.reset();  // it closes every connection
  Receiver second;
  ASSERT_TRUE(second.Start(port).ok());
  // The sender sees the closed connection before its next write and connects again: nothing is
  // written into the old one.
  for (int i = 10; i < 20; ++i) peer->Enqueue("g", {Numbered(i, 10)});
  ASSERT_TRUE(second.WaitFor(10)) << second.size();
  absl::MutexLock lock(&second.mu);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(second.got[i].second.epoch, 10 + i);
}

TEST(StreamPeerTest, AReceiverBackOnAnotherPortIsFoundThroughResolve) {
  Receiver first;
  ASSERT_TRUE(first.Start().ok());
  std::atomic<int> now_at{first.listener->port()};
  std::atomic<int> asked{0};
  auto done = std::make_shared<absl::Notification>();
  StreamPeer peer("me", "the receiver", "127.0.0.1", now_at.load(), [done](const absl::Status&) { done->Notify(); },
                  [&] {
                    ++asked;
                    return now_at.load();
                  });
  done->WaitForNotification();
  peer.Enqueue("g", {Numbered(0, 10)});
  ASSERT_TRUE(first.WaitFor(1));
  EXPECT_EQ(asked.load(), 0);  // not asked while the first connection stands
  first.listener.reset();
  Receiver second;  // a port of its own, as a restarted worker's
  ASSERT_TRUE(second.Start().ok());
  now_at = second.listener->port();
  peer.Enqueue("g", {Numbered(1, 10)});
  ASSERT_TRUE(second.WaitFor(1));
  absl::MutexLock lock(&second.mu);
  EXPECT_EQ(second.got[0].second.epoch, 1);
  EXPECT_GE(asked.load(), 1);
}

TEST(StreamPeerTest, APeerGoneForGoodHandsBackWhatItHeldInOrder) {
  auto receiver = std::make_unique<Receiver>();
  ASSERT_TRUE(receiver->Start().ok());
  auto done = std::make_shared<absl::Notification>();
  absl::Notification lost;
  StreamPeer peer("me", "the receiver", "127.0.0.1", receiver->listener->port(),
                  [done](const absl::Status&) { done->Notify(); }, [] { return 0; }, [&] { lost.Notify(); });
  done->WaitForNotification();
  peer.Enqueue("g", {Numbered(0, 10)});
  ASSERT_TRUE(receiver->WaitFor(1));
  receiver.reset();  // gone, and nothing listens there again
  for (int i = 1; i <= 3; ++i) peer.Enqueue("g", {Numbered(i, 10)});
  ASSERT_TRUE(lost.WaitForNotificationWithTimeout(absl::Seconds(30)));
  peer.Enqueue("g", {Numbered(4, 10)});  // after it gave up: kept for the caller too
  std::deque<std::string> frames = peer.TakeQueued();
  ASSERT_EQ(frames.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    rpc::DataflowBatch batch;
    ASSERT_TRUE(batch.ParseFromArray(frames[i].data() + 4, static_cast<int>(frames[i].size() - 4)));
    EXPECT_EQ(batch.graph(), "g");
    EXPECT_EQ(batch.envelopes(0).epoch(), i + 1);
  }
}

// A sender that closes while its peer is gone (a cluster stopping its workers before its
// controller) does not hold its process for the close's grace: it asks nobody where the peer
// listens now (a lookup that waits for a peer that is gone) and drops what it held once its
// connections are refused, instead of trying until the grace runs out.
TEST(StreamPeerTest, ClosingWhileThePeerIsGoneEndsWithoutWaitingOutTheGrace) {
  auto receiver = std::make_unique<Receiver>();
  ASSERT_TRUE(receiver->Start().ok());
  std::atomic<bool> closing{false};
  std::atomic<int> asked_while_closing{0};
  auto done = std::make_shared<absl::Notification>();
  auto peer = std::make_unique<StreamPeer>(
      "me", "the receiver", "127.0.0.1", receiver->listener->port(), [done](const absl::Status&) { done->Notify(); },
      [&] {
        if (!closing) return 0;
        ++asked_while_closing;
        absl::SleepFor(absl::Seconds(20));  // as a lookup of a peer gone
        return 0;
      });
  done->WaitForNotification();
  peer->Enqueue("g", {Numbered(0, 10)});
  ASSERT_TRUE(receiver->WaitFor(1));
  receiver.reset();  // gone, and nothing listens there again
  // Closing begins before anything is queued for the peer, so every reconnection is tried while
  // closing (no ask can have begun before it).
  const absl::Time start = absl::Now();
  closing = true;
  peer->BeginClose(absl::Now() + absl::Seconds(60));
  for (int i = 1; i <= 3; ++i) peer->Enqueue("g", {Numbered(i, 10)});
  peer.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(asked_while_closing.load(), 0);
}

TEST(StreamPeerTest, GarbageClosesOnlyThatConnection) {
  Receiver r;
  ASSERT_TRUE(r.Start().ok());
  // A client that says hello, then sends a frame longer than any batch may be, then one that
  // does not parse: each connection is closed, and the receiver still serves a real sender.
  for (const std::string& after_hello : {EncodeStreamU32(kMaxDataflowFrameBytes + 1),
                                         absl::StrCat(EncodeStreamU32(5), "xxxxx")}) {
    auto fd = DialStream("test", "127.0.0.1", r.listener->port(), kDataflowStreamMagic, "", absl::Seconds(5));
    ASSERT_TRUE(fd.ok()) << fd.status();
    auto admitted = ReadStreamHeader(*fd, absl::Seconds(5), "test");
    ASSERT_TRUE(admitted.ok()) << admitted.status();
    std::string bytes = after_hello;
    ASSERT_TRUE(TransferAll(*fd, bytes.data(), bytes.size(), true, absl::Now() + absl::Seconds(5), "test").ok());
    char c;
    EXPECT_FALSE(TransferAll(*fd, &c, 1, false, absl::Now() + absl::Seconds(10), "test").ok());  // closed
    close(*fd);
  }
  auto peer = ConnectedOk(r.listener->port());
  ASSERT_NE(peer, nullptr);
  peer->Enqueue("g", {Numbered(1, 3)});
  EXPECT_TRUE(r.WaitFor(1));
}

// A closing sender whose peer takes connections but never answers them (a frozen process, or a
// host that drops packets once connected) gives up within the close's grace, not after the
// connection bound (5 s).
TEST(StreamPeerTest, ClosingWhileThePeerTakesConnectionsButNeverAnswersEndsWithinTheGrace) {
  auto receiver = std::make_unique<Receiver>();
  ASSERT_TRUE(receiver->Start().ok());
  const int port = receiver->listener->port();
  auto peer = ConnectedOk(port);
  ASSERT_NE(peer, nullptr);
  peer->Enqueue("g", {Numbered(0, 10)});
  ASSERT_TRUE(receiver->WaitFor(1));
  receiver.reset();
  // The same port, listening, never accepting: connections complete in the kernel's backlog and
  // nothing is ever said on them.
  const int silent = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(silent, 0);
  const int one = 1;
  setsockopt(silent, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(static_cast<uint16_t>(port));
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&at), sizeof(at)), 0) << Errno(errno);
  ASSERT_EQ(listen(silent, 16), 0);
  const absl::Time start = absl::Now();
  peer->BeginClose(absl::Now() + absl::Milliseconds(300));
  peer->Enqueue("g", {Numbered(1, 10)});
  peer.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3)) << "a connection waited out its own bound";
  close(silent);
}

// Silence is counted from the last byte, not from the frame's start: a batch whose bytes trickle
// in, each before the bound, is handed over whole however long it takes.
TEST(StreamPeerTest, ABatchThatTricklesInIsHandedOverWhole) {
  Receiver r;
  ASSERT_TRUE(r.Start(0, absl::Milliseconds(300)).ok());
  auto fd = DialStream("test", "127.0.0.1", r.listener->port(), kDataflowStreamMagic, "", absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(ReadStreamHeader(*fd, absl::Seconds(5), "test").ok());
  std::string frame = DataflowFrame("me", "g", {Numbered(7, 20)});
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < frame.size(); i += 4) {  // 4 bytes a tenth of a second: over a second
    const size_t n = std::min<size_t>(4, frame.size() - i);
    ASSERT_TRUE(TransferAll(*fd, frame.data() + i, n, true, absl::Now() + absl::Seconds(5), "test").ok());
    absl::SleepFor(absl::Milliseconds(100));  // the trickle itself, not a wait for something
  }
  ASSERT_GT(absl::Now() - start, absl::Seconds(1));
  ASSERT_TRUE(r.WaitFor(1));
  absl::MutexLock lock(&r.mu);
  EXPECT_EQ(r.got[0].second.epoch, 7);
  close(*fd);
}

// How many of this process's threads bear `name`.
int ThreadsNamed(const std::string& name) {
  int n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

// Every sender's stream is read by the listener's one reader thread, not by a thread each (a
// controller of 512 hosts held 512 such threads): all their batches arrive, each sender's in order.
TEST(StreamPeerTest, ManySendersShareOneReaderThreadAndEachKeepsItsOrder) {
  Receiver r;
  ASSERT_TRUE(r.Start().ok());
  constexpr int kSenders = 40, kBatches = 25;
  std::vector<std::unique_ptr<StreamPeer>> peers;
  for (int s = 0; s < kSenders; ++s) {
    peers.push_back(ConnectedOk(r.listener->port()));
    ASSERT_NE(peers.back(), nullptr);
  }
  for (int i = 0; i < kBatches; ++i) {
    for (int s = 0; s < kSenders; ++s) peers[s]->Enqueue(absl::StrCat("g", s), {Numbered(i, 100 + 1000 * (i % 3))});
  }
  ASSERT_TRUE(r.WaitFor(kSenders * kBatches)) << r.size();
  EXPECT_EQ(ThreadsNamed("stream-read"), 1);
  EXPECT_EQ(ThreadsNamed("stream-conn"), 0);
  absl::MutexLock lock(&r.mu);
  std::map<std::string, int64_t> next;
  for (const auto& [graph, e] : r.got) EXPECT_EQ(e.epoch, next[graph]++) << graph;
  EXPECT_EQ(next.size(), static_cast<size_t>(kSenders));
}

// A sender that stops part way through a batch (frozen, or gone without a close) loses that
// connection once the frame has been silent for the protocol's bound; nothing of the batch is
// handed over, and the other senders go on.
TEST(StreamPeerTest, ABatchStoppedPartWayClosesItsConnectionAndIsNotHandedOver) {
  Receiver r;
  ASSERT_TRUE(r.Start(0, absl::Milliseconds(300)).ok());
  auto fd = DialStream("test", "127.0.0.1", r.listener->port(), kDataflowStreamMagic, "", absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(ReadStreamHeader(*fd, absl::Seconds(5), "test").ok());
  std::string part = absl::StrCat(EncodeStreamU32(100), std::string(10, 'x'));
  ASSERT_TRUE(TransferAll(*fd, part.data(), part.size(), true, absl::Now() + absl::Seconds(5), "test").ok());
  char c;
  EXPECT_FALSE(TransferAll(*fd, &c, 1, false, absl::Now() + absl::Seconds(30), "test").ok());  // closed
  close(*fd);
  EXPECT_EQ(r.size(), 0u);
  auto peer = ConnectedOk(r.listener->port());
  ASSERT_NE(peer, nullptr);
  peer->Enqueue("g", {Numbered(1, 3)});
  EXPECT_TRUE(r.WaitFor(1));
}

// Whether this process's threads named `name` number `n` within 30 s (threads end on their own
// time; this looks every 10 ms).
bool EventuallyThreadsNamed(const std::string& name, int n) {
  for (absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until;) {
    if (ThreadsNamed(name) == n) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

// A sender's thread ends once it has had nothing to do for a while (callers write most batches
// themselves), so a controller's idle peers hold no threads; a batch the socket cannot take whole
// starts it again, and so does a receiver that restarted.
TEST(StreamPeerTest, AnIdleSenderHoldsNoThreadAndItsNextBatchesStillGo) {
  Receiver first;
  ASSERT_TRUE(first.Start().ok());
  const int port = first.listener->port();
  auto peer = ConnectedOk(port);
  ASSERT_NE(peer, nullptr);
  peer->Enqueue("g", {Numbered(0, 10)});
  ASSERT_TRUE(first.WaitFor(1));
  ASSERT_TRUE(EventuallyThreadsNamed("flow-peer", 0));
  // More than a socket takes at once, then small ones behind it: the thread comes back for the
  // rest of the large one, and the order holds.
  peer->Enqueue("g", {Numbered(1, size_t{8} << 20)});
  for (int i = 2; i < 5; ++i) peer->Enqueue("g", {Numbered(i, 10)});
  ASSERT_TRUE(first.WaitFor(5)) << first.size();
  {
    absl::MutexLock lock(&first.mu);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(first.got[i].second.epoch, i);
  }
  ASSERT_TRUE(EventuallyThreadsNamed("flow-peer", 0));
  first.listener.reset();  // it closes every connection
  Receiver second;
  ASSERT_TRUE(second.Start(port).ok());
  peer->Enqueue("g", {Numbered(5, 10)});
  ASSERT_TRUE(second.WaitFor(1));
  absl::MutexLock lock(&second.mu);
  EXPECT_EQ(second.got[0].second.epoch, 5);
}

}  // namespace
}  // namespace pathways::dataflow
