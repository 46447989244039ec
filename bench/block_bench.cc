// A block between two worker processes (resharding, pipeline stages): the time from calling a
// function on host B with an array held on host A until its result is ready, against a raw TCP
// stream of the same bytes over loopback measured in the same run. Prints a markdown table; see
// docs/benchmarks.md.
//
//   build/bin/block_bench [--sizes 1MiB,16MiB,64MiB] [--repeats 5]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>

#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "bench_util.h"
#include "client/client.h"
#include "core/process.h"
#include "core/status_macros.h"
#include "testing/subprocess.h"
#include "tools/flags.h"

namespace pathways {
namespace {

using bench::Median;
using bench::Seconds;

// Seconds to stream `bytes` from one thread to another over a loopback TCP connection.
double RawTcp(int64_t bytes) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(listener, 1) != 0) std::abort();
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  std::vector<char> out(static_cast<size_t>(bytes), 1), in(static_cast<size_t>(bytes));
  const int client = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(client, reinterpret_cast<sockaddr*>(&addr), len) != 0) std::abort();
  const int server = accept(listener, nullptr, nullptr);
  const double t = Seconds([&] {
    std::thread sender([&] {
      for (size_t done = 0; done < out.size();) {
        const ssize_t n = send(client, out.data() + done, out.size() - done, 0);
        if (n <= 0) std::abort();
        done += static_cast<size_t>(n);
      }
    });
    for (size_t done = 0; done < in.size();) {
      const ssize_t n = recv(server, in.data() + done, in.size() - done, 0);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
    sender.join();
  });
  close(client);
  close(server);
  close(listener);
  return t;
}

int Main(int argc, char** argv) {
  Subprocess::KillEveryChildWhenParentEnds();  // none outlives a benchmark that is killed
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"sizes", "repeats"});
  const int repeats = static_cast<int>(bench::IntFlagOrExit(flags, "repeats", 5));
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(flags.Get("sizes", "1MiB,16MiB,64MiB"), ',')) {
    auto bytes = ParseBytes(std::string(s));
    if (!bytes.ok() || *bytes < 4 || *bytes > (int64_t{1} << 30)) {
      std::fprintf(stderr, "bad size '%s': want 4 B to 1 GiB\n", std::string(s).c_str());
      return 2;
    }
    sizes.push_back(*bytes);
  }
  if (repeats < 1 || repeats > 100) {
    std::fprintf(stderr, "--repeats must be between 1 and 100\n");
    return 2;
  }
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  Subprocess controller, worker_a, worker_b;
  const std::string address = *StartController(controller, {PATHWAYS_BINARY, "controller", "--listen", "127.0.0.1:0"});
  for (Subprocess* w : {&worker_a, &worker_b}) {
    (void)StartWorker(*w, {PATHWAYS_BINARY, "worker", "--controller", address, "--devices", "1", "--device-memory",
                           std::to_string(4 * largest + (64 << 20))});
  }
  auto client = *Client::Connect(address);
  VirtualSlice a = *client->CreateSlice({.mesh_shape = {1}});
  VirtualSlice b = *client->CreateSlice({.mesh_shape = {1}});
  if (a.host_addresses() == b.host_addresses()) {
    std::fprintf(stderr, "both slices landed on one host\n");
    return 1;
  }
  std::printf(
      "A block from one worker process to another, median of %d; raw TCP is one loopback stream of the "
      "same bytes between two threads, measured in the same run.\n\n",
      repeats);
  std::printf(
      "| bytes | call with block ms | on one host ms | block alone ms | raw TCP ms | raw TCP GB/s | call / raw TCP "
      "rate | block alone / raw TCP rate |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  bench::RowProgress progress("blocks", static_cast<int64_t>(sizes.size()));  // on a terminal, on stderr
  for (int64_t bytes : sizes) {
    progress.Measuring(absl::StrCat(bytes, " bytes"));
    const int64_t n = bytes / 4;
    const TensorSpec spec{DType::kF32, {n}};
    CompiledFunction copy = *client->Compile(FunctionSpec::Builtin("identity", {spec}, {spec}, {{""}}, {{""}}));
    ShardedArray x = *client->Put(*HostArray::Create(DType::kF32, {n}), a, {""});
    (void)client->Ready(x).Await();
    std::vector<double> cross, local, raw;
    for (int r = 0; r < repeats + 1; ++r) {  // the first round warms up
      const double t_cross = Seconds([&] { (void)client->Ready((*client->Call(copy, b, {x}))[0]).Await(); });
      const double t_local = Seconds([&] { (void)client->Ready((*client->Call(copy, a, {x}))[0]).Await(); });
      const double t_raw = RawTcp(bytes);
      if (r == 0) continue;
      cross.push_back(t_cross);
      local.push_back(t_local);
      raw.push_back(t_raw);
    }
    const double c = Median(cross), l = Median(local), w = Median(raw);
    // The block alone: what the call across hosts costs beyond the same call on the block's host.
    const double alone = std::max(c - l, 1e-9);
    progress.Printing();
    std::printf("| %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", static_cast<long long>(bytes), c * 1e3,
                l * 1e3, alone * 1e3, w * 1e3, bytes / w / 1e9, w / c, w / alone);
    std::fflush(stdout);
  }
  client.reset();
  worker_a.Terminate(absl::Seconds(30));
  worker_b.Terminate(absl::Seconds(30));
  controller.Terminate(absl::Seconds(30));
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
