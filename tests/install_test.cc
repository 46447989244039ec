// `make install` as an outside C++ user meets it: the build tree installed into a fresh prefix,
// examples/cpp configured and built as a project of its own against that prefix only
// (find_package(pathways), pathways::client), then run against a cluster started from the
// installed `pathways` binary, with TLS and a token that the program takes from the environment.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

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
  for (std::string file : {std::string("/bin/pathways"), std::string("/include/pathways/client/client.h"),
                            absl::StrCat("/", INSTALL_LIBDIR, "/cmake/pathways/pathwaysConfig.cmake")}) {
    EXPECT_EQ(access((prefix_ + file).c_str(), F_OK), 0) << file << " was not installed";
  }
  // Only the installed prefix is searched: nothing from the build tree or the sources leaks in.
  const std::string example = root_ + "/example";
  MustRun(absl::StrCat(Quote(CMAKE_COMMAND), " -S ", Quote(SOURCE_DIR "/examples/cpp"), " -B ", Quote(example),
                       " -DCMAKE_PREFIX_PATH=", Quote(prefix_), " -DCMAKE_BUILD_TYPE=Release"));
  MustRun(absl::StrCat(Quote(CMAKE_COMMAND), " --build ", Quote(example)));

  const std::string certs = root_ + "/certs";
  MustRun(absl::StrCat(SOURCE_DIR, "/deploy/tls/make_certs.sh ", Quote(certs), " host=127.0.0.1"));
  const std::string installed = prefix_ + "/bin/pathways";
  const std::vector<std::string> tls = {"--tls-cert", certs + "/host.pem", "--tls-key", certs + "/host.key",
                                        "--tls-ca", certs + "/ca.pem", "--token", "install-test-token"};
  auto with_tls = [&](std::vector<std::string> argv) {
    argv.insert(argv.end(), tls.begin(), tls.end());
    return argv;
  };
  Subprocess controller, worker;
  auto address = StartController(controller, with_tls({installed, "controller", "--listen", "127.0.0.1:0"}));
  ASSERT_TRUE(address.ok()) << address.status();
  auto served = StartWorker(worker, with_tls({installed, "worker", "--controller", *address, "--devices", "2",
                                              "--device-memory", "64MiB"}));
  ASSERT_TRUE(served.ok()) << served.status();
  const std::string program = Quote(example + "/matmul_allreduce");
  const std::string secured = absl::StrCat("PATHWAYS_TOKEN=install-test-token PATHWAYS_TLS_CA=", Quote(certs + "/ca.pem"));
  auto [status, out] = RunShell(absl::StrCat(secured, " ", program, " ", *address, " 2"), kStep);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("ok: 4 x 6 on 2 devices"), std::string::npos) << out;
  // Without the authority's certificate the program does not get in: the cluster really is on TLS.
  auto [plain_status, plain_out] =
      RunShell(absl::StrCat("PATHWAYS_TOKEN=install-test-token ", program, " ", *address, " 2"), kStep);
  EXPECT_NE(plain_status, 0) << plain_out;
  EXPECT_EQ(plain_out.find("ok:"), std::string::npos) << plain_out;

  // A bad argument is a clear message and a failing exit, not a crash.
  auto [bad_status, bad_out] = RunShell(absl::StrCat(secured, " ", program, " ", *address, " 0"), kStep);
  EXPECT_TRUE(WIFEXITED(bad_status) && WEXITSTATUS(bad_status) == 2) << bad_out;
  EXPECT_NE(bad_out.find("DEVICES must be a positive number"), std::string::npos) << bad_out;
  worker.Stop(SIGTERM);
  controller.Stop(SIGTERM);
}

}  // namespace
}  // namespace pathways
