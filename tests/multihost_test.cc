// The README's multi-host walk-through, for real: a controller and two workers each in a network
// namespace of its own (one "machine" each, reached by a non-loopback address on a bridge), with
// certificates from deploy/tls/make_certs.sh, a tenants' token and a cluster token, and a tenant
// from a fourth namespace. Needs root (network namespaces); skipped with the reason otherwise.
#include <signal.h>

#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "testing/network_namespaces.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(120);
constexpr char kToken[] = "walk-through-tenant-token";
constexpr char kClusterToken[] = "walk-through-cluster-token";

TEST(MultiHostTest, TheWalkThroughRunsATenantOverTwoHostsWithTlsAndTokens) {
  if (std::string why = NetworkNamespacesUnavailable(); !why.empty()) GTEST_SKIP() << why;
  Network net({"c", "a", "b", "t"});
  ASSERT_TRUE(net.ok()) << net.error();
  const std::string certs = ::testing::TempDir() + "/pathways_walk_through_" + net.Ns("");
  auto [made, made_out] =
      RunShell(absl::StrCat("rm -rf ", certs, " && ", SOURCE_DIR, "/deploy/tls/make_certs.sh ", certs, " controller=",
                            net.Address("c"), " worker-a=", net.Address("a"), " worker-b=", net.Address("b")),
               kTimeout);
  absl::Cleanup remove_certs = [&] { RunShell("rm -rf " + certs, kTimeout); };  // however the test ends
  ASSERT_EQ(made, 0) << made_out;
  auto tls = [&](const std::string& host) {
    return std::vector<std::string>{"--tls-cert", absl::StrCat(certs, "/", host, ".pem"), "--tls-key",
                                    absl::StrCat(certs, "/", host, ".key"), "--tls-ca", certs + "/ca.pem"};
  };
  auto with = [](std::vector<std::string> argv, const std::vector<std::string>& more) {
    argv.insert(argv.end(), more.begin(), more.end());
    return argv;
  };

  // Ports as in the walk-through: each namespace has its own, as each machine would.
  const std::string controller_address = net.Address("c") + ":7000";
  Subprocess controller, worker_a, worker_b;
  auto listening = StartController(
      controller, net.In("c", with({PATHWAYS_BINARY, "controller", "--listen", controller_address, "--token", kToken,
                                    "--cluster-token", kClusterToken},
                                   tls("controller"))),
      kTimeout);
  ASSERT_TRUE(listening.ok()) << listening.status();
  EXPECT_EQ(*listening, controller_address);
  for (auto [process, host] : {std::pair{&worker_a, "a"}, std::pair{&worker_b, "b"}}) {
    auto served = StartWorker(*process,
                              net.In(host, with({PATHWAYS_BINARY, "worker", "--controller", controller_address,
                                                 "--listen", net.Address(host) + ":7100", "--data-port", "7101",
                                                 "--link-port", "7102", "--devices", "2",
                                                 "--token", kToken, "--cluster-token", kClusterToken},
                                                tls(absl::StrCat("worker-", host)))),
                              kTimeout);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_EQ(*served, net.Address(host) + ":7100");
  }

  // A tenant needs only the authority's certificate and the tenants' token.
  auto tenant = [&](const std::vector<std::string>& flags) {
    return RunShell(absl::StrJoin(net.In("t", with({PATHWAYS_BINARY, "tenant", "--controller", controller_address,
                                                    "--devices", "4", "--runs", "50"},
                                                   flags)),
                                  " ") +
                        " 2>&1",
                    kTimeout);
  };
  auto [ok_status, ok_out] = tenant({"--tls-ca", certs + "/ca.pem", "--token", kToken});
  EXPECT_EQ(ok_status, 0) << ok_out;
  EXPECT_NE(ok_out.find("CHECK PASSED"), std::string::npos) << ok_out;
  auto [status_rc, status_out] = RunShell(
      absl::StrJoin(net.In("t", {PATHWAYS_BINARY, "status", "--controller", controller_address, "--tls-ca",
                                 certs + "/ca.pem", "--token", kToken}),
                    " "),
      kTimeout);
  EXPECT_EQ(status_rc, 0) << status_out;
  for (const char* host : {"a", "b"}) {
    EXPECT_NE(status_out.find(net.Address(host) + ":7100"), std::string::npos) << status_out;
  }

  // With a wrong token, or without the authority's certificate: refused.
  auto [no_token, no_token_out] = tenant({"--tls-ca", certs + "/ca.pem", "--token", "wrong"});
  EXPECT_NE(no_token, 0);
  EXPECT_NE(no_token_out.find("the token sent is not this cluster's"), std::string::npos) << no_token_out;
  auto [no_ca, no_ca_out] = tenant({"--token", kToken});
  EXPECT_NE(no_ca, 0) << no_ca_out;
  EXPECT_EQ(no_ca_out.find("CHECK PASSED"), std::string::npos) << no_ca_out;

  for (Subprocess* p : {&worker_a, &worker_b, &controller}) EXPECT_EQ(p->Stop(SIGTERM) & 0x7f, 0);
}

}  // namespace
}  // namespace pathways
