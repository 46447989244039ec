// Servers flooded with connections past their descriptors recover once the connections close.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"
#include "multiprocess_fixture.h"
#include "testing/subprocess.h"

namespace pathways {
namespace {

using ::pathways::testing::DialLoopback;

// Opens `count` connections to `port` that never speak, waits (bounded) until process `pid`
// holds 120 descriptors or more, then closes them. Whether the process ran out.
bool FloodThenClose(pid_t pid, int port, int count) {
  auto open_descriptors = [&] {
    int n = 0;
    for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
      ++n;
    }
    return n;
  };
  std::vector<int> flood;
  for (int i = 0; i < count; ++i) {
    const int fd = DialLoopback(port);
    if (fd < 0) {
      ADD_FAILURE() << "connection " << i << ": " << std::strerror(errno);
      break;
    }
    flood.push_back(fd);
  }
  for (int i = 0; i < 200 && open_descriptors() < 120; ++i) absl::SleepFor(absl::Milliseconds(50));
  const bool ran_out = open_descriptors() >= 120;
  for (int fd : flood) close(fd);
  return ran_out;
}

// UBSan's own checks need descriptors (it probes whether memory is readable through a pipe):
// out of them, it reports every virtual call as on an "invalid vptr" and aborts the server.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PW_SKIP_UNDER_SANITIZERS() \
  GTEST_SKIP() << "not under sanitizers: their runtime needs descriptors the test takes away"
#endif
#endif
#ifndef PW_SKIP_UNDER_SANITIZERS
#define PW_SKIP_UNDER_SANITIZERS() (void)0
#endif

// Connections are a bounded resource: a controller allowed 128 descriptors, flooded with 300
// connections that never speak, drops what it cannot hold and serves again once they close.
// (Its cap of connections per port is set above its descriptors, which would otherwise keep it
// from running out.)
// (gRPC 1.51's listener stops accepting for good after one accept fails with EMFILE.)
TEST(ConnectionFloodTest, AServerOutOfDescriptorsServesAgainOnceTheyClose) {
  PW_SKIP_UNDER_SANITIZERS();
  Subprocess controller;
  auto started = StartController(
      controller, {"/usr/bin/prlimit", "--nofile=128:128", PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0",
                   "--max-connections", "1000"});
  ASSERT_TRUE(started.ok()) << started.status();
  const std::string address = *started;
  EXPECT_TRUE(FloodThenClose(controller.pid(), std::stoi(address.substr(address.rfind(':') + 1)), 300));
  // Once they are closed it serves: a status call and a worker's registration.
  auto status = RunShell(absl::StrCat("exec ", PATHWAYS_BINARY, " status --controller ", address), absl::Seconds(60));
  EXPECT_TRUE(WIFEXITED(status.first) && WEXITSTATUS(status.first) == 0) << status.second;
  Subprocess worker;
  auto registered = StartWorker(worker, {PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "1"});
  EXPECT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ(worker.Stop(SIGTERM), 0);
  EXPECT_EQ(controller.Stop(SIGTERM), 0);
}

// Each listening port holds at most --max-connections: a controller capped at 32, flooded with 150
// connections that never speak, closes those beyond the cap at once (its descriptors stay within
// the cap, with descriptors left over), keeps its worker, and serves new clients once the flood
// closes. Without the cap it would hold all 150.
TEST(ConnectionFloodTest, AListenerHoldsAtMostItsCapOfConnections) {
  Subprocess controller, worker;
  auto started = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0",
                                              "--max-connections", "32"});
  ASSERT_TRUE(started.ok()) << started.status();
  const std::string address = *started;
  auto registered = StartWorker(worker, {PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "1"});
  ASSERT_TRUE(registered.ok()) << registered.status();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  auto open_descriptors = [&] {
    int n = 0;
    for ([[maybe_unused]] const auto& entry :
         std::filesystem::directory_iterator(absl::StrCat("/proc/", controller.pid(), "/fd"))) {
      ++n;
    }
    return n;
  };
  const int before = open_descriptors();
  constexpr int kFlood = 150;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(DialLoopback(port));
    ASSERT_GE(flood.back(), 0) << std::strerror(errno);
  }
  // The controller closes those beyond its cap: their reads see the end of the stream.
  auto closed_by_server = [&] {
    int closed = 0;
    for (int fd : flood) {
      pollfd p{fd, POLLIN, 0};
      char c;
      if (poll(&p, 1, 0) == 1 && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0) ++closed;
    }
    return closed;
  };
  int closed = 0;
  for (int i = 0; i < 200 && (closed = closed_by_server()) < kFlood - 32; ++i) absl::SleepFor(absl::Milliseconds(25));
  EXPECT_GE(closed, kFlood - 32);
  EXPECT_LE(open_descriptors(), before + 32 + 4);  // (a few for its own channels meanwhile)
  for (int fd : flood) close(fd);
  // The worker was never refused (its connection predates the flood), and new clients are served.
  auto status = RunShell(absl::StrCat("exec ", PATHWAYS_BINARY, " status --controller ", address), absl::Seconds(60));
  EXPECT_TRUE(WIFEXITED(status.first) && WEXITSTATUS(status.first) == 0) << status.second;
  EXPECT_NE(status.second.find(" alive "), std::string::npos) << status.second;
  EXPECT_EQ(status.second.find("DEAD"), std::string::npos) << status.second;
  auto bad = RunShell(absl::StrCat("exec ", PATHWAYS_BINARY, " controller --listen 127.0.0.1:0 --max-connections 0"),
                      absl::Seconds(30));
  EXPECT_NE(bad.second.find("--max-connections: connections per listener must be"), std::string::npos) << bad.second;
  EXPECT_NE(bad.first, 0);
  EXPECT_EQ(worker.Stop(SIGTERM), 0);
  EXPECT_EQ(controller.Stop(SIGTERM), 0);
}

// The same for a worker: flooded past its descriptors, it still runs a client's job afterwards.
TEST(ConnectionFloodTest, AWorkerOutOfDescriptorsRunsJobsAgainOnceTheyClose) {
  PW_SKIP_UNDER_SANITIZERS();
  Subprocess controller, worker;
  auto started = StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"});
  ASSERT_TRUE(started.ok()) << started.status();
  const std::string address = *started;
  auto serving = StartWorker(worker, {"/usr/bin/prlimit", "--nofile=128:128", PATHWAYS_BINARY, "worker", "--controller",
                                      address, "--devices", "2", "--device-memory", "64MiB",
                                      "--max-connections", "1000"});
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(FloodThenClose(worker.pid(), std::stoi(serving->substr(serving->rfind(':') + 1)), 300));
  auto client = Client::Connect(address);
  ASSERT_TRUE(client.ok()) << client.status();
  VirtualSlice slice = *(*client)->CreateSlice({.mesh_shape = {2}});
  const TensorSpec row{DType::kF32, {8}};
  auto sum = *(*client)->Compile(FunctionSpec::Builtin("all_reduce_sum@x", {row}, {row}, {{"x"}}, {{"x"}}));
  ShardedArray x = *(*client)->Put(Pattern({8}, 1.0f), slice, {"x"});
  auto call = (*client)->Call(sum, slice, {x});
  ASSERT_TRUE(call.ok()) << call.status();
  auto out = (*client)->Fetch((*call)[0]).AwaitFor(absl::Seconds(60));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->data<float>()[0], Pattern({8}, 1.0f).data<float>()[0] + Pattern({8}, 1.0f).data<float>()[4]);
  client->reset();
  EXPECT_EQ(worker.Stop(SIGTERM), 0);
  EXPECT_EQ(controller.Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace pathways
