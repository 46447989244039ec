// The mesh between hosts (peer_mesh.h, tcp_links.h), hosts as threads in one process over real
// loopback connections: hosts out of step or ordered differently, emulated links between islands,
// members that disagree, peers that send garbage, flood or never send, and failures told to the
// peers. Peers that will not come to a call (gone, stopping, withdrawn): peer_mesh_departures_test.
#include "collective/peer_mesh.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "collective/collective_internal.h"
#include "collective/cross_host.h"
#include "collective/loopback_hosts.h"
#include "collective/tcp_links.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"

namespace pathways::collective {
namespace {

TEST(PeerMeshTest, AMessageForAnotherCallAbortsAtOnceAndTheMeshReconnects) {
  Hosts hosts(2);
  char a = 'a', b = 'b';
  // The two hosts run different calls (different tags): each sees the other's tag.
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads;
  for (int h = 0; h < 2; ++h) {
    threads.emplace_back([&, h] {
      const CallId id{h == 0 ? 100u : 200u, 0};
      results[h] =
          hosts.links(h).Run({"host0", "host1"}, h, "k", id, absl::Now() + absl::Seconds(10), [&](PeerMesh& mesh) {
            MeshSteps steps(mesh, id, 7, absl::Now() + absl::Seconds(10));
            std::vector<PeerTransfer> t{{1 - h, {{h == 0 ? &a : &b, 1}}, {{h == 0 ? &b : &a, 1}}, nullptr}};
            return steps.Step(t);
          });
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) {
    EXPECT_TRUE(absl::IsAborted(r) || absl::IsUnavailable(r)) << r;
  }
  EXPECT_TRUE(absl::IsAborted(results[0]) || absl::IsAborted(results[1]));
  EXPECT_NE(results[0].message().find("ordered differently"), std::string::npos) << results[0];
  // The next call on the same devices meets again.
  int32_t v[2] = {1, 2};
  ExpectAllOk(hosts.Run("k", 300, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  }));
  EXPECT_EQ(v[0], 3);
  EXPECT_EQ(v[1], 3);
}

// Each host runs its own list of executions (an all_reduce each) on one mesh; returns each
// host's statuses in its order.
std::vector<std::vector<absl::Status>> RunSequences(Hosts& hosts, const std::vector<std::vector<uint64_t>>& executions,
                                                    std::vector<std::vector<int32_t>>& values) {
  std::vector<std::vector<absl::Status>> results(executions.size());
  std::vector<std::thread> threads;
  for (int h = 0; h < static_cast<int>(executions.size()); ++h) {
    threads.emplace_back([&, h] {
      for (uint64_t e : executions[h]) {
        values[h].push_back(h + 1);
        char* p = reinterpret_cast<char*>(&values[h].back());
        results[h].push_back(hosts.links(h).Run(
            {"host0", "host1"}, h, "k", {e, 0}, absl::Now() + absl::Seconds(20), [&](PeerMesh& mesh) {
              MeshSteps steps(mesh, {e, 0}, 7, absl::Now() + absl::Seconds(20));
              return AllReduceAcrossHosts(steps, DType::kI32, ReduceOp::kSum, p, p, 1);
            }));
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

TEST(PeerMeshTest, AHostThatSkippedACallIsMetAgainWithinOneCall) {
  // Host 1 never makes execution 1's call (its run failed before it): host 0 abandons that call
  // as soon as host 1's next message comes. Neither can tell whether an execution it does not
  // know is behind or ahead of the other, so host 1 may lose execution 2 too; from execution 3
  // on both meet.
  Hosts hosts(2);
  std::vector<std::vector<int32_t>> values(2);
  for (auto& v : values) v.reserve(8);
  auto results = RunSequences(hosts, {{1, 2, 3}, {2, 3}}, values);
  EXPECT_TRUE(absl::IsAborted(results[0][0])) << results[0][0];
  EXPECT_TRUE(results[1][0].ok() || absl::IsAborted(results[1][0])) << results[1][0];
  EXPECT_TRUE(results[0][2].ok()) << results[0][2];
  EXPECT_TRUE(results[1][1].ok()) << results[1][1];
  EXPECT_EQ(values[0][2], 3);
  EXPECT_EQ(values[1][1], 3);
}

TEST(PeerMeshTest, AHostWithAnExtraCallLosesAtMostOneMoreAndThenMeetsItsPeer) {
  // Host 1 makes a call host 0 never makes (execution 9): it is abandoned, host 0 may lose the
  // call it was in when host 1's message came, and from then on both meet.
  Hosts hosts(2);
  std::vector<std::vector<int32_t>> values(2);
  for (auto& v : values) v.reserve(8);
  auto results = RunSequences(hosts, {{2, 3, 4}, {9, 2, 3, 4}}, values);
  EXPECT_TRUE(absl::IsAborted(results[1][0])) << results[1][0];
  EXPECT_TRUE(results[0][0].ok() || absl::IsAborted(results[0][0])) << results[0][0];
  for (int i = 1; i < 3; ++i) EXPECT_TRUE(results[0][i].ok()) << results[0][i];
  for (int i = 2; i < 4; ++i) EXPECT_TRUE(results[1][i].ok()) << results[1][i];
  EXPECT_EQ(values[0][2], 3);
  EXPECT_EQ(values[1][3], 3);
}

TEST(PeerMeshTest, StepsBetweenIslandsTakeTheEmulatedLatency) {
  Hosts hosts(2, {.latency = absl::Milliseconds(40)});
  int32_t v[2] = {1, 2};
  // Connect first: setting up the mesh is not what is measured.
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) { return absl::OkStatus(); }));
  const absl::Time start = absl::Now();
  // Recursive doubling over two hosts is one exchange each way, plus the same again.
  for (uint64_t call = 0; call < 2; ++call) {
    ExpectAllOk(hosts.Run("k", 10 + call, [&](int h, MeshSteps& s) {
      char* p = reinterpret_cast<char*>(&v[h]);
      return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
    }));
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(80));
  EXPECT_EQ(v[0], 6);
  EXPECT_EQ(v[1], 6);
}

TEST(PeerMeshTest, AMessageOfTheWrongSizeIsRefusedNamingThePeer) {
  Hosts hosts(2);
  std::vector<int32_t> x(4, 1), y(8, 1);
  auto results = hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(h == 0 ? x.data() : y.data());
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, h == 0 ? 4 : 8);
  });
  EXPECT_TRUE(absl::IsInvalidArgument(results[0])) << results[0];
  EXPECT_NE(results[0].message().find("host1"), std::string::npos) << results[0];
}

// Members that disagree on the size, over algorithms of several rounds: a host that finds the
// mismatch tells its peers why before it closes, so every host that fails says the cause
// (InvalidArgument, "disagree"), including those that were waiting for another host in a later
// round, and none waits for the deadline. One host sends twice the bytes of the others.
class DisagreementTest : public ::testing::TestWithParam<std::tuple<int /*hosts*/, int /*odd host*/>> {};

TEST_P(DisagreementTest, EveryHostThatFailsSaysTheCause) {
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const int n = std::get<0>(GetParam()), odd = std::get<1>(GetParam());
  Hosts hosts(n);
  auto unit = [odd](int h) -> size_t { return h == odd ? 2 : 1; };
  const char* kinds[] = {"all_gather", "all_to_all", "broadcast"};
  for (uint64_t k = 0; k < std::size(kinds); ++k) {
    SCOPED_TRACE(kinds[k]);
    std::vector<std::string> in(n, std::string(2 * n, 'x')), out(n, std::string(2 * n, 'y'));
    const absl::Time start = absl::Now();
    auto results = hosts.Run(
        "k", 1 + k,
        [&](int h, MeshSteps& s) {
          const size_t u = unit(h);
          if (k == 0) {
            Segments segments(n);
            for (int g = 0; g < n; ++g) segments[g].push_back({out[h].data() + g * u, u});
            return AllGatherAcrossHosts(s, segments, SmallAlgorithm::kLogRounds);
          }
          if (k == 1) {
            std::vector<std::vector<Piece>> send(n), recv(n);
            for (int g = 0; g < n; ++g) {
              if (g == h) continue;
              send[g] = {{in[h].data() + g * u, u}};
              recv[g] = {{out[h].data() + g * u, u}};
            }
            return AllToAllAcrossHosts(
                s, send, recv, [&](int, int) { return u; }, SmallAlgorithm::kLogRounds);
          }
          return BroadcastAcrossHosts(s, (odd + 1) % n, out[h].data(), u, SmallAlgorithm::kLogRounds);
        },
        absl::Seconds(20));
    EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "found by size, not by the deadline";
    int failed = 0;
    for (int h = 0; h < n; ++h) {
      if (results[h].ok()) continue;
      ++failed;
      EXPECT_TRUE(absl::IsInvalidArgument(results[h])) << "host " << h << ": " << results[h];
      EXPECT_NE(results[h].message().find("disagree"), std::string::npos) << "host " << h << ": " << results[h];
    }
    EXPECT_GT(failed, 0);
  }
  // The mesh meets again for the next call.
  std::vector<int32_t> v(n, 1);
  ExpectAllOk(hosts.Run("k", 10, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  }));
  for (int h = 0; h < n; ++h) EXPECT_EQ(v[h], n);
}

INSTANTIATE_TEST_SUITE_P(HostsAndOddHost, DisagreementTest,
                         ::testing::Values(std::make_tuple(4, 0), std::make_tuple(4, 1), std::make_tuple(4, 3),
                                           std::make_tuple(5, 2), std::make_tuple(8, 5)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "hosts_odd", std::get<1>(info.param));
                         });

// A member of the cluster whose connection carries bytes that are no collective message, in the
// middle of a call: the call fails at once naming it (not at the deadline), and the next call,
// over a fresh connection, works.
TEST(PeerMeshTest, GarbageFromAPeerMidCallFailsTheCallNamingItAndTheNextCallWorks) {
  Hosts hosts(2);
  int32_t v[2] = {1, 2};
  auto all_reduce = [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  };
  ExpectAllOk(hosts.Run("k", 1, all_reduce));  // the mesh is connected
  const absl::Time start = absl::Now();
  auto results = hosts.Run(
      "k", 2,
      [&](int h, MeshSteps& s) -> absl::Status {
        if (h == 0) return all_reduce(h, s);
        const std::string garbage(sizeof(MessageHeader) + 16, '\x5a');
        const int fd = s.mesh().TEST_fd(0);
        if (fd < 0 || write(fd, garbage.data(), garbage.size()) != static_cast<ssize_t>(garbage.size())) {
          return absl::InternalError("could not write the garbage");
        }
        return absl::OkStatus();
      },
      absl::Seconds(20));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "found by reading, not by the deadline";
  ASSERT_TRUE(results[1].ok()) << results[1];
  EXPECT_TRUE(absl::IsInvalidArgument(results[0])) << results[0];
  EXPECT_NE(results[0].message().find("host1 sent bytes that are not a collective message"), std::string::npos)
      << results[0];
  // Host 1 fails a call too: it finds host 0 gone and drops its end, and both meet again.
  hosts.links(1)
      .Run({"host0", "host1"}, 1, "k", {2, 0}, absl::Now() + absl::Seconds(1),
           [](PeerMesh&) { return absl::UnavailableError("the garbage was sent"); })
      .IgnoreError();
  ExpectTwoHostsMeet(hosts, 3);
}

// A host gives up on a call its peer never came to (the peer's run failed before it): the host
// closes that connection rather than keep it, since the peer, which cannot tell that call from a
// later one, would take the host's message and notice for a later call's and abandon its next
// call. Both meet in the next call.
TEST(PeerMeshTest, APeerThatNeverCameToAFailedCallMeetsTheHostInTheNext) {
  Hosts hosts(2);
  ExpectTwoHostsMeet(hosts, 1);  // the mesh is connected
  const absl::Time deadline = absl::Now() + absl::Milliseconds(300);
  int32_t v = 1;
  const absl::Status alone = hosts.links(0).Run({"host0", "host1"}, 0, "k", {2, 0}, deadline, [&](PeerMesh& mesh) {
    MeshSteps steps(mesh, {2, 0}, 7, deadline);
    return AllReduceAcrossHosts(steps, DType::kI32, ReduceOp::kSum, reinterpret_cast<char*>(&v),
                                reinterpret_cast<char*>(&v), 1);
  });
  EXPECT_TRUE(absl::IsDeadlineExceeded(alone)) << alone;
  ExpectTwoHostsMeet(hosts, 3);
}

// A peer that keeps sending what the call drops (whole messages of an execution this host is done
// with) cannot hold the call past its deadline: progress does not put the deadline off.
TEST(PeerMeshTest, AStreamOfStaleMessagesDoesNotHoldACallPastItsDeadline) {
  Hosts hosts(2);
  ExpectTwoHostsMeet(hosts, 1);  // connected; execution 1 is done on both
  std::atomic<bool> done = false;
  absl::Duration took;
  const absl::Time start = absl::Now();
  auto results = hosts.Run(
      "k", 2,
      [&](int h, MeshSteps& s) -> absl::Status {
        if (h == 0) {
          int32_t v = 1;
          char* p = reinterpret_cast<char*>(&v);
          absl::Status status = AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
          took = absl::Now() - start;
          done = true;
          return status;
        }
        // Host 1 never takes part: it streams messages of execution 1 for 5 s at most.
        MessageHeader stale{};
        stale.magic = 0x50574331;  // a collective message's
        stale.signature = 7;
        stale.execution = 1;
        stale.bytes = 4;
        std::string burst;
        for (int i = 0; i < 256; ++i) {
          burst.append(reinterpret_cast<const char*>(&stale), sizeof(stale));
          burst.append(4, 'x');
        }
        const int fd = s.mesh().TEST_fd(0);
        size_t at = 0;
        for (const absl::Time until = absl::Now() + absl::Seconds(5); !done && absl::Now() < until;) {
          const ssize_t n = write(fd, burst.data() + at, burst.size() - at);
          if (n < 0 && errno != EAGAIN && errno != EINTR) return absl::InternalError("the stream broke");
          if (n > 0) at = (at + static_cast<size_t>(n)) % burst.size();
        }
        return absl::OkStatus();
      },
      absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(results[0])) << results[0];
  EXPECT_LT(took, absl::Seconds(2)) << "held past its deadline";
}

TEST(PeerMeshTest, APeerThatNeverSendsTimesOutNamingIt) {
  Hosts hosts(3);
  int32_t v[3] = {1, 1, 1};
  auto results = hosts.Run(
      "k", 1,
      [&](int h, MeshSteps& s) {
        if (h == 2) return absl::OkStatus();  // connects, then never takes part
        char* p = reinterpret_cast<char*>(&v[h]);
        return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
      },
      absl::Milliseconds(500));
  EXPECT_TRUE(absl::IsDeadlineExceeded(results[0]) || absl::IsDeadlineExceeded(results[1]));
  for (int h = 0; h < 2; ++h) {
    if (absl::IsDeadlineExceeded(results[h])) {
      EXPECT_NE(results[h].message().find("host"), std::string::npos);
    }
  }
}

// In rounds, a host can wait for one that is itself stuck: the errors say which round, so that
// the chain can be followed to the host that stopped. Bruck's all_gather over 4 hosts with host 2
// silent: host 1 waits for it in round 1; host 3 waits for host 1 in round 2.
TEST(PeerMeshTest, AHostWaitingInALaterRoundSaysWhichRound) {
  Hosts hosts(4);
  std::vector<std::string> data(4, std::string(4, 'x'));
  auto results = hosts.Run(
      "k", 1,
      [&](int h, MeshSteps& s) {
        if (h == 2) return absl::OkStatus();  // connects, then never takes part
        Segments segments(4);
        for (int g = 0; g < 4; ++g) segments[g].push_back({data[h].data() + g, 1});
        return AllGatherAcrossHosts(s, segments, SmallAlgorithm::kLogRounds);
      },
      absl::Milliseconds(500));
  ASSERT_TRUE(absl::IsDeadlineExceeded(results[1])) << results[1];
  EXPECT_NE(results[1].message().find("still waiting for host(s) host2"), std::string::npos) << results[1];
  EXPECT_EQ(results[1].message().find("round"), std::string::npos) << results[1];
  // Host 0 waits for host 2 too, in round 2 (host 2 keeps its connections open).
  ASSERT_TRUE(absl::IsDeadlineExceeded(results[0])) << results[0];
  EXPECT_NE(results[0].message().find("still waiting for host(s) host2"), std::string::npos) << results[0];
  EXPECT_NE(results[0].message().find("in round 2 of the call"), std::string::npos) << results[0];
  // Host 3 waits for host 1, which may have given up and closed its connections first.
  ASSERT_FALSE(results[3].ok());
  EXPECT_NE(results[3].message().find("host1"), std::string::npos) << results[3];
  if (absl::IsDeadlineExceeded(results[3])) {
    EXPECT_NE(results[3].message().find("in round 2 of the call"), std::string::npos) << results[3];
  }
}

TEST(PeerMeshTest, GarbageOnTheListenerIsDroppedAndCollectivesGoOn) {
  Hosts hosts(2);
  // A stranger connects to host0's listener and sends bytes that are no hello.
  const std::string address = hosts.links(0).address();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string garbage(64, '\x7f');
  ASSERT_EQ(write(fd, garbage.data(), garbage.size()), static_cast<ssize_t>(garbage.size()));
  int32_t v[2] = {5, 6};
  ExpectAllOk(hosts.Run("k", 1, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  }));
  EXPECT_EQ(v[0], 11);
  close(fd);
}

// Hosts prove the cluster's secret when they connect: one with another secret (a stranger who
// knows the protocol) is dropped, its peer's collective fails in bounded time, and hosts that
// share the secret meet as before.
TEST(PeerMeshTest, AHostWithoutTheClusterSecretCannotJoinAMesh) {
  {
    Hosts strangers(2, {}, {"cluster secret", "a guess"});
    int32_t v[2] = {5, 6};
    std::vector<absl::Status> results = strangers.Run(
        "k", 1,
        [&](int h, MeshSteps& s) {
          char* p = reinterpret_cast<char*>(&v[h]);
          return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
        },
        absl::Seconds(3));
    EXPECT_FALSE(results[0].ok());
    EXPECT_FALSE(results[1].ok());
    EXPECT_EQ(v[0], 5);
  }
  Hosts members(2, {}, {"cluster secret", "cluster secret"});
  int32_t v[2] = {5, 6};
  ExpectAllOk(members.Run("k", 1, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  }));
  EXPECT_EQ(v[0], 11);
}

// Connections that open and say nothing (a scanner, a stalled peer, a hostile tenant) hold up no
// one: hellos are read side by side, so the hosts meet while 20 silent connections sit on each
// listener (read one after another, at 2 s each, they held the listener for 40 s).
TEST(PeerMeshTest, SilentConnectionsDoNotHoldUpTheListener) {
  Hosts hosts(2);
  std::vector<int> silent;
  for (int h = 0; h < hosts.size(); ++h) {
    ASSERT_TRUE(hosts.links(h).Publish().ok());
    const std::string address = hosts.links(h).address();
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 20; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0) << std::strerror(errno);
      silent.push_back(fd);
    }
  }
  int32_t v[2] = {5, 6};
  ExpectAllOk(hosts.Run(
      "k", 1,
      [&](int h, MeshSteps& s) {
        char* p = reinterpret_cast<char*>(&v[h]);
        return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
      },
      absl::Seconds(10)));
  EXPECT_EQ(v[0], 11);
  for (int fd : silent) close(fd);
}

}  // namespace
}  // namespace pathways::collective
