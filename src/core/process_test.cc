#include "core/process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"

namespace pathways {
namespace {

using ::pathways::testing::DialLoopback;
using ::pathways::testing::ListenLoopback;

// Accepts what is queued, as a server's listener does on readiness.
std::vector<int> AcceptQueued(int listener) {
  std::vector<int> accepted;
  pollfd p{listener, POLLIN, 0};
  while (poll(&p, 1, 100) == 1) {
    const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) accepted.push_back(fd);
    if (fd < 0 && errno != ECONNABORTED) break;
  }
  return accepted;
}

bool ClosedByPeer(int fd, int wait_ms = 2000) {
  pollfd p{fd, POLLIN, 0};
  char c;
  return poll(&p, 1, wait_ms) == 1 && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

TEST(ConnectionCapTest, AListenerKeepsAtMostItsCapAndTakesMoreOnceSomeClose) {
  InitServingProcess();
  ASSERT_TRUE(SetConnectionsPerListener(2).ok());
  int port = 0;
  const int listener = ListenLoopback(&port, /*nonblocking=*/true);
  ASSERT_GE(listener, 0);
  std::vector<int> dialed;
  for (int i = 0; i < 5; ++i) dialed.push_back(DialLoopback(port));
  std::vector<int> kept = AcceptQueued(listener);
  EXPECT_EQ(kept.size(), 2u);
  // The three beyond were closed as soon as they were accepted, all of them on one readiness.
  for (int i = 2; i < 5; ++i) EXPECT_TRUE(ClosedByPeer(dialed[i])) << i;
  EXPECT_FALSE(ClosedByPeer(dialed[0], 0));
  // Once one closes, a newcomer is kept (closed ones are counted again after at least 20 ms).
  close(kept[0]);
  absl::SleepFor(absl::Milliseconds(30));  // the pruning interval, not a wait for an event
  const int newcomer = DialLoopback(port);
  std::vector<int> more = AcceptQueued(listener);
  EXPECT_EQ(more.size(), 1u);
  EXPECT_FALSE(ClosedByPeer(newcomer, 0));
  for (int fd : dialed) close(fd);
  for (int fd : more) close(fd);
  close(kept[1]);
  close(newcomer);
  close(listener);
  EXPECT_EQ(ConnectionsPerListener(), 2);
  ASSERT_TRUE(SetConnectionsPerListener(1 << 20).ok());
}

TEST(ConnectionCapTest, BadCapsAreRefused) {
  EXPECT_EQ(SetConnectionsPerListener(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetConnectionsPerListener(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetConnectionsPerListener(int64_t{1} << 40).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pathways
