// Block streams between hosts as objects in one process over real loopback connections: blocks
// of every size land intact and in order, refusals and stalls come back to the sender with the
// receiver's reason, garbage closes only the stream it came on, and the emulated DCN delays.
#include "collective/block_streams.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "collective/collective.h"
#include "core/socket_util.h"
#include "collective/tcp_links.h"
#include "core/future.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

// Two hosts' links and block streams. Host 1 lands blocks through `land` (by default into
// `received`, keyed by the header).
class Pair {
 public:
  explicit Pair(absl::Duration timeout = absl::Seconds(10), DcnOptions dcn = {}) {
    for (int h = 0; h < 2; ++h) {
      if (dcn.enabled()) {
        dcns_[h] = std::make_unique<DcnEmulation>(h, dcn);
        for (int g = 0; g < 2; ++g) dcns_[h]->NoteHost(Name(g), g);
      }
      links_[h] = *TcpLinks::Create(Name(h), "127.0.0.1", store_, dcns_[h].get());
      EXPECT_TRUE(links_[h]->Publish().ok());
    }
    streams_[0] = std::make_unique<BlockStreams>(*links_[0], Name(0), dcns_[0].get(), timeout,
                                                 [](const std::string&, const std::string&, uint64_t)
                                                     -> absl::StatusOr<BlockStreams::Landing> {
                                                   return absl::InternalError("host 0 takes no blocks");
                                                 });
    streams_[1] = std::make_unique<BlockStreams>(
        *links_[1], Name(1), dcns_[1].get(), timeout,
        [this](const std::string& from, const std::string& header, uint64_t bytes) { return land(from, header, bytes); });
  }
  static std::string Name(int h) { return absl::StrCat("host", h); }

  // Sends from host 0 to host 1 and waits for the sender's verdict.
  absl::Status Send(const std::string& header, const std::vector<char>& data) {
    Promise<Unit> promise;
    Future<Unit> done = promise.future();
    auto keep = std::make_shared<std::vector<char>>(data);
    streams_[0]->Send(Name(1), header, keep->data(), keep->size(), keep,
                      [p = std::make_shared<Promise<Unit>>(std::move(promise))](absl::Status s) {
                        p->Set(s.ok() ? absl::StatusOr<Unit>(Unit{}) : s);
                      });
    return done.Await().status();
  }

  std::function<absl::StatusOr<BlockStreams::Landing>(const std::string&, const std::string&, uint64_t)> land =
      [this](const std::string& from, const std::string& header, uint64_t bytes)
      -> absl::StatusOr<BlockStreams::Landing> {
    EXPECT_EQ(from, Name(0));
    auto buffer = std::make_shared<std::vector<char>>(bytes);
    return BlockStreams::Landing{buffer->data(), [this, header, buffer](absl::Status s) {
                                   absl::MutexLock lock(&mu);
                                   if (s.ok()) received[header] = *buffer;
                                 }};
  };
  absl::Mutex mu;
  std::map<std::string, std::vector<char>> received ABSL_GUARDED_BY(mu);
  BlockStreams& streams(int h) { return *streams_[h]; }
  void StopSender() { streams_[0].reset(); }
  TcpLinks& links(int h) { return *links_[h]; }

 private:
  std::shared_ptr<InMemoryKeyValueStore> store_ = std::make_shared<InMemoryKeyValueStore>();
  std::unique_ptr<DcnEmulation> dcns_[2];
  std::unique_ptr<TcpLinks> links_[2];
  std::unique_ptr<BlockStreams> streams_[2];
};

std::vector<char> Bytes(size_t n, int seed) {
  std::vector<char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed) % 251);
  return v;
}

TEST(BlockStreamsTest, BlocksOfEverySizeLandIntact) {
  Pair pair;
  // Empty, tiny, not a multiple of the chunk size, several chunks.
  const std::vector<size_t> sizes = {0, 1, 4097, BlockStreams::kChunkBytes + 3, 3 * BlockStreams::kChunkBytes};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(pair.Send(absl::StrCat("b", i), Bytes(sizes[i], static_cast<int>(i))).ok()) << sizes[i];
  }
  absl::MutexLock lock(&pair.mu);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(pair.received[absl::StrCat("b", i)], Bytes(sizes[i], static_cast<int>(i))) << sizes[i];
  }
  EXPECT_EQ(pair.streams(0).counts().blocks_sent, static_cast<int64_t>(sizes.size()));
  EXPECT_EQ(pair.streams(1).counts().blocks_received, static_cast<int64_t>(sizes.size()));
  int64_t total = 0;
  for (auto n : sizes) total += static_cast<int64_t>(n);
  EXPECT_EQ(pair.streams(0).counts().bytes_sent, total);
  EXPECT_EQ(pair.streams(1).counts().bytes_received, total);
}

// A block past 2 GiB (where protobuf's messages and a signed 32-bit size stop) lands whole: bytes
// marked on both sides of the limit arrive where they were. Both sides are anonymous
// mappings: the sender's pages are never written but for the marks (the rest read as zeros), the
// receiver's are written once, by the stream.
TEST(BlockStreamsTest, ABlockPastTwoGiBLandsWhole) {
  const uint64_t bytes = (uint64_t{1} << 31) + 12345;
  auto map = [&] {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  };
  char* const out = map();
  char* const in = map();
  ASSERT_NE(out, nullptr);
  ASSERT_NE(in, nullptr);
  const std::vector<uint64_t> marks = {0, (uint64_t{1} << 31) - 1, uint64_t{1} << 31, bytes - 1};
  for (size_t i = 0; i < marks.size(); ++i) out[marks[i]] = static_cast<char>(i + 1);
  Pair pair(absl::Seconds(60));
  Promise<Unit> landed_promise;
  Future<Unit> landed = landed_promise.future();
  pair.land = [&](const std::string&, const std::string&, uint64_t size) -> absl::StatusOr<BlockStreams::Landing> {
    EXPECT_EQ(size, bytes);
    return BlockStreams::Landing{in, [&](absl::Status s) {
                                   landed_promise.Set(s.ok() ? absl::StatusOr<Unit>(Unit{}) : s);
                                 }};
  };
  Promise<Unit> sent_promise;
  Future<Unit> sent = sent_promise.future();
  pair.streams(0).Send(Pair::Name(1), "big", out, bytes, nullptr, [&](absl::Status s) {
    sent_promise.Set(s.ok() ? absl::StatusOr<Unit>(Unit{}) : s);
  });
  ASSERT_TRUE(sent.Await().ok()) << sent.Await().status();
  ASSERT_TRUE(landed.Await().ok()) << landed.Await().status();
  for (size_t i = 0; i < marks.size(); ++i) EXPECT_EQ(in[marks[i]], static_cast<char>(i + 1)) << marks[i];
  EXPECT_EQ(in[12345], 0);
  EXPECT_EQ(pair.streams(1).counts().bytes_received, static_cast<int64_t>(bytes));
  munmap(out, bytes);
  munmap(in, bytes);
}

TEST(BlockStreamsTest, ManyQueuedBlocksArriveInOrder) {
  std::vector<std::string> order;  // outlives the streams that write it
  Pair pair;
  pair.land = [&](const std::string&, const std::string& header, uint64_t bytes)
      -> absl::StatusOr<BlockStreams::Landing> {
    auto buffer = std::make_shared<std::vector<char>>(bytes);
    return BlockStreams::Landing{buffer->data(), [&, header, buffer](absl::Status) {
                                   absl::MutexLock lock(&pair.mu);
                                   order.push_back(header);
                                 }};
  };
  constexpr int kBlocks = 50;
  std::vector<Future<Unit>> done;
  for (int i = 0; i < kBlocks; ++i) {
    Promise<Unit> p;
    done.push_back(p.future());
    auto keep = std::make_shared<std::vector<char>>(Bytes(1000 + i, i));
    pair.streams(0).Send(Pair::Name(1), absl::StrCat(i), keep->data(), keep->size(), keep,
                         [p = std::make_shared<Promise<Unit>>(std::move(p))](absl::Status s) {
                           p->Set(s.ok() ? absl::StatusOr<Unit>(Unit{}) : s);
                         });
  }
  for (auto& f : done) ASSERT_TRUE(f.Await().ok());
  absl::MutexLock lock(&pair.mu);
  ASSERT_EQ(order.size(), static_cast<size_t>(kBlocks));
  for (int i = 0; i < kBlocks; ++i) EXPECT_EQ(order[i], absl::StrCat(i));
}

TEST(BlockStreamsTest, ARefusalReachesTheSenderAndTheStreamCarriesOn) {
  std::vector<char> scratch;
  Pair pair;
  pair.land = [](const std::string&, const std::string& header, uint64_t) -> absl::StatusOr<BlockStreams::Landing> {
    return absl::ResourceExhaustedError(absl::StrCat("no room for ", header));
  };
  absl::Status s = pair.Send("big", Bytes(BlockStreams::kChunkBytes * 2, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("no room for big"), std::string::npos) << s;
  EXPECT_NE(s.message().find("host1"), std::string::npos) << s;  // names the receiver
  pair.land = [&](const std::string&, const std::string&, uint64_t bytes) -> absl::StatusOr<BlockStreams::Landing> {
    scratch.resize(bytes);
    return BlockStreams::Landing{scratch.data(), [](absl::Status) {}};
  };
  EXPECT_TRUE(pair.Send("next", Bytes(10, 2)).ok());
  EXPECT_EQ(scratch, Bytes(10, 2));
}

TEST(BlockStreamsTest, AStalledReceiverFailsTheBlockInTimeAndTheNextOneGoesThrough) {
  absl::Notification release;
  // A landing each: once released, the stalled block's reader still lands what its sender had
  // written before it gave up, while the next block lands.
  std::vector<char> stalled(64), next(64);
  Pair pair(absl::Milliseconds(300));
  pair.land = [&](const std::string&, const std::string& header, uint64_t) -> absl::StatusOr<BlockStreams::Landing> {
    if (header != "stalled") return BlockStreams::Landing{next.data(), [](absl::Status) {}};
    release.WaitForNotification();  // lands nothing until told
    return BlockStreams::Landing{stalled.data(), [](absl::Status) {}};
  };
  absl::Status s = pair.Send("stalled", Bytes(64, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("host1"), std::string::npos) << s;
  release.Notify();
  // The stalled stream was closed; the next block dials a new one.
  EXPECT_TRUE(pair.Send("next", Bytes(64, 2)).ok());
  EXPECT_EQ(next, Bytes(64, 2));
}

TEST(BlockStreamsTest, GarbageClosesOnlyItsOwnStream) {
  Pair pair;
  ASSERT_TRUE(pair.Send("before", Bytes(100, 1)).ok());
  // A process that knows the hello but then sends nonsense.
  auto fd = pair.links(0).DialStream(Pair::Name(1), "#blocks", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(fd.ok()) << fd.status();
  std::string garbage(64, 'x');
  ASSERT_TRUE(TransferAll(*fd, garbage.data(), garbage.size(), true, absl::Now() + absl::Seconds(5), "garbage").ok());
  // The receiver closes it.
  char c;
  EXPECT_FALSE(TransferAll(*fd, &c, 1, false, absl::Now() + absl::Seconds(10), "close").ok());
  close(*fd);
  EXPECT_TRUE(pair.Send("after", Bytes(100, 2)).ok());
  absl::MutexLock lock(&pair.mu);
  EXPECT_EQ(pair.received["after"], Bytes(100, 2));
}

TEST(BlockStreamsTest, TheEmulatedDcnDelaysBlocksBetweenIslands) {
  Pair pair(absl::Seconds(10), DcnOptions{absl::Milliseconds(40), 0});
  ASSERT_TRUE(pair.Send("warm", Bytes(10, 0)).ok());
  const absl::Time start = absl::Now();
  ASSERT_TRUE(pair.Send("late", Bytes(10, 1)).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
}

TEST(BlockStreamsTest, ShuttingDownFailsWhatIsQueued) {
  absl::Notification landing, release;
  std::atomic<bool> first{true};
  std::vector<char> scratch(8);
  Pair pair;
  pair.land = [&](const std::string&, const std::string&, uint64_t) -> absl::StatusOr<BlockStreams::Landing> {
    if (first.exchange(false)) landing.Notify();
    release.WaitForNotification();  // the first block is never acknowledged before the sender stops
    return BlockStreams::Landing{scratch.data(), [](absl::Status) {}};
  };
  std::vector<absl::Status> results(3);
  absl::Mutex mu;
  int finished = 0;
  for (int i = 0; i < 3; ++i) {
    auto keep = std::make_shared<std::vector<char>>(Bytes(8, i));
    pair.streams(0).Send(Pair::Name(1), absl::StrCat(i), keep->data(), keep->size(), keep, [&, i](absl::Status s) {
      absl::MutexLock lock(&mu);
      results[i] = s;
      ++finished;
    });
  }
  landing.WaitForNotification();
  pair.StopSender();
  release.Notify();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(finished, 3);
  EXPECT_FALSE(results[0].ok());  // cut while waiting for its acknowledgement
  EXPECT_EQ(results[1].code(), absl::StatusCode::kCancelled) << results[1];
  EXPECT_EQ(results[2].code(), absl::StatusCode::kCancelled) << results[2];
}

}  // namespace
}  // namespace pathways::collective
