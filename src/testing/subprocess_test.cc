// The benchmarks' and tests' way to run programs: output read back, and a command past its
// deadline stopped (SIGTERM, so that a launcher stops what it started; then SIGKILL).
#include "testing/subprocess.h"

#include <unistd.h>

#include <cstdio>
#include <string>

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

}  // namespace
}  // namespace pathways
