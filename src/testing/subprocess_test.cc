// The benchmarks' and tests' way to run programs: output read back, and a command past its
// deadline stopped (SIGTERM, so that a launcher stops what it started; then SIGKILL).
#include "testing/subprocess.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(RunCommandTest, ReturnsTheOutput) {
  auto out = RunCommand({"/bin/sh", "-c", "echo one; echo two"}, absl::Seconds(30));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "one\ntwo\n");
}

TEST(RunCommandTest, ACommandPastItsDeadlineIsTerminatedWithWhatItStarted) {
  // The shell starts a child and, on SIGTERM, stops it and says so (as mpirun stops its ranks).
  const std::string marker = ::testing::TempDir() + "/run_command_terminated";
  std::remove(marker.c_str());
  const absl::Time start = absl::Now();
  auto out = RunCommand({"/bin/sh", "-c",
                         "sleep 60 & child=$!; trap 'kill $child; touch " + marker + "; exit 1' TERM; echo started; wait"},
                        absl::Milliseconds(500));
  EXPECT_TRUE(absl::IsDeadlineExceeded(out.status())) << out.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_EQ(access(marker.c_str(), F_OK), 0) << "the command saw no SIGTERM";
}

TEST(RunCommandTest, ACommandThatIgnoresSigtermIsKilled) {
  const absl::Time start = absl::Now();
  auto out = RunCommand({"/bin/sh", "-c", "trap '' TERM; echo started; while true; do sleep 1; done"},
                        absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(out.status())) << out.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}


// A child started by a thread that ends is killed with it: what keeps a benchmark's cluster from
// outliving a benchmark that is killed. One Subprocess asks for it, or every one of the process.
TEST(SubprocessTest, AChildOfAThreadThatEndsIsKilledWhenAsked) {
  for (bool every : {false, true}) {
    Subprocess child;
    if (every) {
      Subprocess::KillEveryChildWhenParentEnds();
    } else {
      child.KillWhenParentEnds();
    }
    std::thread starter([&] { ASSERT_TRUE(child.Start({"/bin/sleep", "1000"}).ok()); });
    starter.join();
    absl::StatusOr<int> status = child.WaitFor(absl::Seconds(30));
    ASSERT_TRUE(status.ok()) << "the child outlived the thread that started it";
    EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << *status;
  }
}


TEST(SubprocessTest, AProgramThatCannotRunIsSaidSoAtStart) {
  Subprocess child;
  absl::Status started = child.Start({"/nonexistent/program"});
  EXPECT_EQ(started.code(), absl::StatusCode::kInvalidArgument) << started;
  EXPECT_NE(started.message().find("/nonexistent/program"), std::string::npos) << started;
  EXPECT_EQ(child.pid(), -1);
}

}  // namespace
}  // namespace pathways
