// `make install` as an outside C++ user meets it: the build tree installed into a fresh prefix,
// examples/cpp configured and built as a project of its own against that prefix only
// (find_package(pathways), pathways::client), then run against a cluster started from the
// installed `pathways` binary.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

constexpr absl::Duration kStep = absl::Seconds(240);

std::string Quote(const std::string& s) { return absl::StrCat("'", s, "'"); }

class InstallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    root_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/pathways-install-test-", getpid());
    prefix_ = root_ + "/prefix";
    ASSERT_EQ(RunShell(absl::StrCat("rm -rf ", Quote(root_), " && mkdir -p ", Quote(root_)), kStep).first, 0);
  }
  void TearDown() override { RunShell(absl::StrCat("rm -rf ", Quote(root_)), kStep); }

  // Runs `command`; fails the test with its output unless it exits 0.
  void MustRun(const std::string& command) {
    auto [status, out] = RunShell(command, kStep);
    ASSERT_EQ(status, 0) << command << "\n" << out;
  }

  std::string root_, prefix_;
};

TEST_F(InstallTest, AnOutsideProjectBuildsAgainstTheInstalledTreeAndRunsOnItsCluster) {
  MustRun(absl::StrCat(Quote(CMAKE_COMMAND), " --install ", Quote(BUILD_DIR), " --prefix ", Quote(prefix_)));
  for (const char* file : {"/bin/pathways", "/include/pathways/client/client.h", "/lib/cmake/pathways/pathwaysConfig.cmake"}) {
    EXPECT_EQ(access((prefix_ + file).c_str(), F_OK), 0) << file << " was not installed";
  }
  // Only the installed prefix is searched: nothing from the build tree or the sources leaks in.
  const std::string example = root_ + "/example";
  MustRun(absl::StrCat(Quote(CMAKE_COMMAND), " -S ", Quote(SOURCE_DIR "/examples/cpp"), " -B ", Quote(example),
                       " -DCMAKE_PREFIX_PATH=", Quote(prefix_), " -DCMAKE_BUILD_TYPE=Release"));
  MustRun(absl::StrCat(Quote(CMAKE_COMMAND), " --build ", Quote(example)));

  const std::string installed = prefix_ + "/bin/pathways";
  Subprocess controller, worker;
  auto address = StartController(controller, {installed, "controller", "--listen", "127.0.0.1:0"});
  ASSERT_TRUE(address.ok()) << address.status();
  auto served = StartWorker(worker, {installed, "worker", "--controller", *address, "--devices", "2",
                                     "--device-memory", "64MiB"});
  ASSERT_TRUE(served.ok()) << served.status();
  auto [status, out] = RunShell(absl::StrCat(Quote(example + "/matmul_allreduce"), " ", *address, " 2"), kStep);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("ok: 4 x 6 on 2 devices"), std::string::npos) << out;

  // A bad argument is a clear message and a failing exit, not a crash.
  auto [bad_status, bad_out] = RunShell(absl::StrCat(Quote(example + "/matmul_allreduce"), " ", *address, " 0"), kStep);
  EXPECT_TRUE(WIFEXITED(bad_status) && WEXITSTATUS(bad_status) == 2) << bad_out;
  EXPECT_NE(bad_out.find("DEVICES must be a positive number"), std::string::npos) << bad_out;
  worker.Stop(SIGTERM);
  controller.Stop(SIGTERM);
}

}  // namespace
}  // namespace pathways
