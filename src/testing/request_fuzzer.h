// Feeds arbitrary bytes, as requests, to the code that decodes and validates what clients and
// workers send: a host runtime (no network: every host named in a program is rewritten to the
// runtime itself), the controller's registry and an island scheduler. Shared by the libFuzzer
// target (fuzz/request_fuzzer.cc) and the bounded randomized test in `make test`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "controller/cluster_registry.h"
#include "dataflow/dataflow_service.h"
#include "worker/host_runtime.h"

namespace pathways {

// Not thread-safe: one Feed at a time.
class RequestFuzzer {
 public:
  static constexpr char kHost[] = "127.0.0.1:1";
  RequestFuzzer();
  // The first byte picks the request kind; the rest is its serialized message. Never crashes:
  // whatever is wrong must come back as a Status (which is discarded).
  void Feed(const uint8_t* data, size_t size);
  HostRuntime& runtime() { return *runtime_; }
  // How many inputs decoded into a request and reached the code under test.
  int64_t decoded() const { return decoded_; }
  ClusterRegistry& registry() { return registry_; }

 private:
  // Parses `M` from the payload and, if it parses, counts it and hands it to `apply`.
  template <typename M, typename F>
  void Decode(const void* payload, int length, F apply) {
    M message;
    if (!message.ParseFromArray(payload, length)) return;
    ++decoded_;
    apply(message);
  }

  dataflow::DataflowService dataflow_;
  std::unique_ptr<HostRuntime> runtime_;
  ClusterRegistry registry_;
  int64_t decoded_ = 0;
};

}  // namespace pathways
