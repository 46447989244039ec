// Peers that will not come to a call, hosts as threads in one process over real loopback
// connections (peer_mesh.h, tcp_links.h): a host that left the island, a host that stops, a call
// its host no longer wants, a host whose members withdrew or that never started the run, a frozen
// peer being dialed. Each ends the waiting call within a moment, not at its deadline.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collective/collective_internal.h"
#include "collective/cross_host.h"
#include "collective/loopback_hosts.h"
#include "collective/peer_mesh.h"
#include "collective/tcp_links.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

// A call over a host that left the island (the controller said so) fails at once with why, on
// the host that waits for it to dial in and on the one that dials it, whether the call was
// already waiting or comes after: not at its deadline. Once the host is back, calls meet again.
TEST(PeerMeshTest, ACallOverAHostThatLeftFailsAtOnceNamingIt) {
  Hosts hosts(2);
  const absl::Duration deadline = absl::Seconds(60);
  for (int waiter = 0; waiter < 2; ++waiter) {
    const int gone = 1 - waiter;
    const CallId id{static_cast<uint64_t>(10 + waiter), 0};
    absl::Status waited;
    const absl::Time start = absl::Now();
    std::thread call([&] {
      waited = hosts.links(waiter).Run({"host0", "host1"}, waiter, "k", id, absl::Now() + deadline,
                                       [&](PeerMesh&) { return absl::OkStatus(); });
    });
    // Whether the call waits already or has not begun, it ends: by the wake-up or by the check first.
    hosts.links(waiter).SetDeparted({{absl::StrCat("host", gone), "silent past the heartbeat timeout"}});
    call.join();
    EXPECT_TRUE(absl::IsUnavailable(waited)) << waited;
    EXPECT_NE(waited.message().find(absl::StrCat("host", gone, " left the island (silent past the heartbeat")),
              std::string::npos)
        << waited;
    EXPECT_LT(absl::Now() - start, deadline / 2) << "the call waited for its deadline";
    // A later call fails before it waits at all.
    absl::Status later = hosts.links(waiter).Run({"host0", "host1"}, waiter, "k", {id.execution + 100, 0},
                                                 absl::Now() + deadline, [&](PeerMesh&) { return absl::OkStatus(); });
    EXPECT_TRUE(absl::IsUnavailable(later)) << later;
    hosts.links(waiter).SetDeparted({});
  }
  ExpectTwoHostsMeet(hosts, 300);
}

// A host that left before it ever published where it listens (its first call saw the departure
// before publishing, as host0's can above) is found to have left by a call that looks it up, not
// at the call's deadline: the lookup is bounded like a dial attempt. Before, a clean clone's
// `make test` once waited out the 60 s above this way.
TEST(PeerMeshTest, ACallOverAHostThatLeftBeforeItPublishedFailsAtOnce) {
  Hosts hosts(2);
  const absl::Duration deadline = absl::Seconds(60);
  const absl::Time start = absl::Now();
  absl::Status waited;
  std::thread call([&] {
    waited = hosts.links(1).Run({"host0", "host1"}, 1, "k", {7, 0}, absl::Now() + deadline,
                                [&](PeerMesh&) { return absl::OkStatus(); });
  });
  // Most often the call is looking host0 up by then; either way it must end at once.
  absl::SleepFor(absl::Milliseconds(100));
  hosts.links(1).SetDeparted({{"host0", "silent past the heartbeat timeout"}});
  call.join();
  EXPECT_TRUE(absl::IsUnavailable(waited)) << waited;
  EXPECT_NE(waited.message().find("host0 left the island"), std::string::npos) << waited;
  EXPECT_LT(absl::Now() - start, deadline / 2) << "the call waited for its deadline";
}

// A call on a connected mesh that waits for a peer's message ends once the peer has left the
// island (frozen: its connection stays open), not at the call's deadline.
// Host0's all_reduce with host1, which never comes to it, once connected; `end_the_wait` runs
// while the call waits (either order passes; this one lets the call reach its wait first, as a
// freeze mid-call does). What the call ended with, which must be well before its deadline.
// `wanted` is the call's TcpLinks::Run check.
absl::Status AllReduceThatHost1NeverComesTo(Hosts& hosts, const std::function<void()>& end_the_wait,
                                            const std::function<absl::Status()>& wanted = nullptr) {
  ExpectTwoHostsMeet(hosts, 1);  // connected
  absl::Status status;
  const absl::Duration deadline = absl::Seconds(60);
  const absl::Time start = absl::Now();
  std::thread call([&] {
    status = hosts.links(0).Run(
        {"host0", "host1"}, 0, "k", {2, 0}, absl::Now() + deadline,
        [&](PeerMesh& mesh) {
          MeshSteps steps(mesh, {2, 0}, 7, absl::Now() + deadline);
          int32_t v = 1;
          char* p = reinterpret_cast<char*>(&v);
          return AllReduceAcrossHosts(steps, DType::kI32, ReduceOp::kSum, p, p, 1);
        },
        wanted);
  });
  absl::SleepFor(absl::Milliseconds(300));
  end_the_wait();
  call.join();
  EXPECT_LT(absl::Now() - start, deadline / 2) << "the call waited for its deadline";
  return status;
}

TEST(PeerMeshTest, AnExchangeWaitingForAPeerThatLeftEndsNamingIt) {
  Hosts hosts(2);
  const absl::Status status = AllReduceThatHost1NeverComesTo(hosts, [&] {
    hosts.links(0).SetDeparted({{"host1", "silent past the heartbeat timeout"}});
  });
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_NE(status.message().find("host1 left the island"), std::string::npos) << status;
  hosts.links(0).SetDeparted({});
  ExpectTwoHostsMeet(hosts, 3);
}

// A worker told to stop (SIGTERM: CollectiveHub::Shutdown, then TcpLinks::StopWaiting) does not
// wait out the deadline of a call whose peer never comes: the device thread in it ends at once, so
// the process exits instead of holding its shutdown for the collective timeout.
TEST(PeerMeshTest, AnExchangeWaitingForAPeerEndsWhenItsHostStops) {
  Hosts hosts(2);
  const absl::Status status = AllReduceThatHost1NeverComesTo(hosts, [&] { hosts.links(0).StopWaiting(); });
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_NE(status.message().find("host0 is shutting down"), std::string::npos) << status;
}

// A call its host no longer wants (TcpLinks::Run's check: its client went away) stops waiting for
// a peer's message within a moment, with the check's reason, and the two hosts meet in the next.
TEST(PeerMeshTest, AnExchangeWaitingForAPeerEndsOnceItsHostNoLongerWantsIt) {
  Hosts hosts(2);
  std::atomic<bool> gone{false};
  const absl::Status status = AllReduceThatHost1NeverComesTo(
      hosts, [&] { gone = true; },
      [&] { return gone ? absl::CancelledError("client c went away") : absl::OkStatus(); });
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
  EXPECT_NE(status.message().find("client c went away"), std::string::npos) << status;
  ExpectTwoHostsMeet(hosts, 3);
}

// A host remembers 4096 runs it never started (TcpLinks::RunNotStarted) for the peers that ask; past
// that the client holding the most loses its oldest, so twenty clients that fail run after run
// there together push out only their own records, never an honest client's.
TEST(PeerMeshTest, RunsAHostNeverStartedAreForgottenFromTheClientThatHoldsTheMost) {
  Hosts hosts(2);
  ExpectTwoHostsMeet(hosts, 1);  // connected, and published
  constexpr uint64_t kOther = 1;
  for (uint64_t run = 1000; run < 1010; ++run) {
    hosts.links(1).RunNotStarted(run, kOther, absl::NotFoundError("program 7 is not registered on host1"));
  }
  constexpr int kFlooders = 20, kRunsEach = 300;  // 6000 runs, past the 4096 a host keeps
  for (uint64_t r = 1; r <= kRunsEach; ++r) {
    for (uint64_t f = 0; f < kFlooders; ++f) {
      hosts.links(1).RunNotStarted((f + 1) * 100000 + r, 100 + f,
                                   absl::NotFoundError("program 9 is not registered on host1"));
    }
  }
  const absl::Time soon = absl::Now() + absl::Seconds(10);
  for (uint64_t run = 1000; run < 1010; ++run) {
    const absl::Status other = hosts.links(0).AskWithdrawn("host1", {5, 0, run}, soon);
    EXPECT_TRUE(absl::IsNotFound(other)) << run << ": " << other;
    EXPECT_EQ(other.message(), "program 7 is not registered on host1");
  }
  for (uint64_t f = 0; f < kFlooders; ++f) {
    const uint64_t first = (f + 1) * 100000 + 1;
    EXPECT_TRUE(absl::IsNotFound(hosts.links(0).AskWithdrawn("host1", {6, 0, first + kRunsEach - 1}, soon)));
    EXPECT_TRUE(hosts.links(0).AskWithdrawn("host1", {6, 0, first}, soon).ok()) << "flooder " << f << "'s oldest";
  }
}

// A host whose members withdrew from a call (CollectiveHub::Withdraw) answers a peer that asks,
// from that call on, with why (a code that would keep the asker in the call reads as Unavailable);
// a peer waiting for it in the call ends within a moment, not at its deadline; and the two meet
// in the next call on the connections they had (what the waiter sent is dropped as of a call the
// withdrawn host is done with).
TEST(PeerMeshTest, APeerWaitingForAHostThatWithdrewFromTheCallAsksItAndEnds) {
  Hosts hosts(2);
  ExpectTwoHostsMeet(hosts, 1);  // connected, and published
  hosts.links(1).Withdrew({{5, 2, Fnv64("k"), absl::ResourceExhaustedError("device 1 is full")},
                           {6, 0, Fnv64("k"), absl::InvalidArgumentError("unknown mesh axis")}});
  const absl::Time soon = absl::Now() + absl::Seconds(10);
  EXPECT_TRUE(hosts.links(0).AskWithdrawn("host1", {5, 1}, soon).ok()) << "it made call 1";
  absl::Status two = hosts.links(0).AskWithdrawn("host1", {5, 2}, soon);
  EXPECT_TRUE(absl::IsResourceExhausted(two)) << two;
  EXPECT_EQ(two.message(), "device 1 is full");
  EXPECT_TRUE(absl::IsUnavailable(hosts.links(0).AskWithdrawn("host1", {6, 0}, soon)));
  EXPECT_TRUE(hosts.links(0).AskWithdrawn("host1", {7, 0}, soon).ok()) << "nothing known of it";

  const absl::Duration deadline = absl::Seconds(60);
  const absl::Time start = absl::Now();
  absl::Status status =
      hosts.links(0).Run({"host0", "host1"}, 0, "k", {5, 3}, absl::Now() + deadline, [&](PeerMesh& mesh) {
        MeshSteps steps(mesh, {5, 3}, 7, absl::Now() + deadline);
        int32_t v = 1;
        char* p = reinterpret_cast<char*>(&v);
        return AllReduceAcrossHosts(steps, DType::kI32, ReduceOp::kSum, p, p, 1);
      });
  EXPECT_TRUE(absl::IsResourceExhausted(status)) << status;
  EXPECT_NE(status.message().find("device 1 is full"), std::string::npos) << status;
  EXPECT_LT(absl::Now() - start, deadline / 2) << "the call waited for its deadline";
  ExpectTwoHostsMeet(hosts, 8);
}

// A host that dials a frozen peer (its kernel takes the connection; nothing answers the
// handshake) finds it has left the island between two attempts, not at the call's deadline.
TEST(PeerMeshTest, ADialToAFrozenPeerEndsOnceThePeerLeft) {
  auto store = std::make_shared<InMemoryKeyValueStore>();
  auto links = TcpLinks::Create("host1", "127.0.0.1", store);
  ASSERT_TRUE(links.ok()) << links.status();
  // The frozen peer: a listening socket that never accepts.
  const int frozen = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(frozen, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(frozen, 16), 0);
  ASSERT_EQ(getsockname(frozen, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ASSERT_TRUE(store->Set("collective-links/frozen", absl::StrCat("127.0.0.1:", ntohs(addr.sin_port))).ok());
  absl::Status status;
  const absl::Duration deadline = absl::Seconds(60);
  const absl::Time start = absl::Now();
  // host1 is rank 1 over {frozen, host1}: it dials the frozen peer.
  std::thread call([&] {
    status = (*links)->Run({"frozen", "host1"}, 1, "k", {1, 0}, absl::Now() + deadline,
                           [](PeerMesh&) { return absl::OkStatus(); });
  });
  // Once the dial reached the peer's kernel, the peer is said to have left.
  pollfd p{frozen, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 30000), 1);
  (*links)->SetDeparted({{"frozen", "silent past the heartbeat timeout"}});
  call.join();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_NE(status.message().find("frozen left the island"), std::string::npos) << status;
  EXPECT_LT(absl::Now() - start, deadline / 2) << "the dial waited for the call's deadline";
  close(frozen);
}

}  // namespace
}  // namespace pathways::collective
