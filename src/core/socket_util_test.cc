#include "core/socket_util.h"

#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

class SocketPair {
 public:
  SocketPair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  ~SocketPair() {
    CloseWriter();
    close(fds_[0]);
  }
  int reader() const { return fds_[0]; }
  void Write(const std::string& bytes) { ASSERT_EQ(write(fds_[1], bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size())); }
  void CloseWriter() {
    if (fds_[1] >= 0) close(fds_[1]);
    fds_[1] = -1;
  }

 private:
  int fds_[2] = {-1, -1};
};

TEST(ReadFrameWhileMovingTest, AFrameOfSeveralPiecesArrivesWhole) {
  SocketPair pair;
  std::string frame(3 << 20, 'a');
  frame[12345] = 'b';
  std::string got = "left over";
  std::thread writer([&] { pair.Write(frame); });
  ASSERT_TRUE(ReadFrameWhileMoving(pair.reader(), got, frame.size(), absl::Seconds(10), "frame").ok());
  writer.join();
  EXPECT_EQ(got, frame);
}

// A peer that announces a large frame and sends a few bytes of it holds no more than a piece of
// this process's memory, not the size it announced.
TEST(ReadFrameWhileMovingTest, AnAnnouncedFrameThatNeverComesTakesNoMoreThanWhatCame) {
  SocketPair pair;
  pair.Write("only this");
  pair.CloseWriter();
  std::string got;
  const absl::Status s = ReadFrameWhileMoving(pair.reader(), got, size_t{256} << 20, absl::Seconds(10), "frame");
  EXPECT_FALSE(s.ok());
  EXPECT_LE(got.capacity(), size_t{2} << 20);
}

// One poll tells each connection apart: one closed with unread bytes counts as closed (the peer
// said why and left), one open with unread bytes does not, and a missing one (-1) never does.
TEST(PeersClosedTest, TellsEachConnectionApartInOneCall) {
  SocketPair open_with_bytes, closed_with_bytes, open_quiet;
  open_with_bytes.Write("hello");
  closed_with_bytes.Write("why");
  closed_with_bytes.CloseWriter();
  const int fds[] = {open_with_bytes.reader(), -1, closed_with_bytes.reader(), open_quiet.reader()};
  EXPECT_EQ(PeersClosed(fds), (std::vector<bool>{false, false, true, false}));
  EXPECT_TRUE(PeerClosed(closed_with_bytes.reader()));
  EXPECT_FALSE(PeerClosed(open_with_bytes.reader()));
}

}  // namespace
}  // namespace pathways
