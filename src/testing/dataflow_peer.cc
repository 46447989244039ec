// A process that hosts its share of the sparse-sum test dataflow, for the cross-process test.
// Prints "address HOST:PORT", reads the three host addresses from one line of stdin, prints
// "ready", then drives its source shards and prints "result KEY VALUE" per result; exits on EOF.
#include <cstdio>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "dataflow/grpc_transport.h"
#include "testing/sparse_sum_graph.h"

using namespace pathways;
using namespace pathways::dataflow;

int main(int argc, char** argv) {
  int epochs = argc > 1 ? std::atoi(argv[1]) : 5;
  // With a stream listener: the peers send each other batches over plain TCP, and the test's
  // own host (which has none) over gRPC.
  auto host = StartLoopbackDataflowHost(/*streams=*/true);
  if (!host.ok()) return 1;
  const std::string self = (*host)->address;
  std::printf("address %s\n", self.c_str());
  std::fflush(stdout);

  std::string line;
  if (!std::getline(std::cin, line)) return 1;
  std::istringstream in(line);
  std::vector<std::string> hosts(3);
  in >> hosts[0] >> hosts[1] >> hosts[2];
  absl::Mutex print_mu;
  SparseSumResults results([&](const std::string& key, int64_t value) {
    absl::MutexLock lock(&print_mu);
    std::printf("result %s %lld\n", key.c_str(), static_cast<long long>(value));
    std::fflush(stdout);
  });
  ThreadPool pool("peer", 2);
  GrpcTransport transport(self);
  auto engine = std::make_shared<Engine>(self, MakeSparseSumGraph(hosts), SparseSumOperators(results), transport, pool);
  (void)(*host)->service.AddEngine(engine.get());
  {
    absl::MutexLock lock(&print_mu);
    std::printf("ready\n");
    std::fflush(stdout);
  }
  if (!std::getline(std::cin, line) || line != "go") return 1;
  DriveSparseSum(*engine, epochs, /*seed=*/11);
  while (std::getline(std::cin, line)) {
  }
  host->reset();
  pool.Shutdown();
  return 0;
}
