// An emulated data-centre network between islands, for benchmarks and tests on one machine.
//
// Islands are joined by the DCN, slower than the interconnect within an island. On one machine
// every host is a loopback hop away, so the transports ask this model how long a message to a
// host of another island takes: a one-way latency plus its size over a bandwidth, messages on one
// link following each other. Traffic within an island, to the controller, or to a host whose
// island is not known yet is not delayed. Applied in user space by the senders and receivers
// (collective links, dataflow transfers): no root, no qdisc. Hosts learn each other's islands
// from the programs they run (SliceDevice.island).
#pragma once

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pathways {

struct DcnOptions {
  absl::Duration latency = absl::ZeroDuration();  // one way
  double gbps = 0;                                // 0: unlimited
  bool enabled() const { return latency > absl::ZeroDuration() || gbps > 0; }
};

// One host's view of the links to other hosts. Thread-safe.
class DcnEmulation {
 public:
  DcnEmulation(int island, DcnOptions options) : island_(island), options_(options) {}
  const DcnOptions& options() const { return options_; }

  void NoteHost(const std::string& host, int island);
  // Whether traffic with `host` crosses the emulated DCN.
  bool Crosses(const std::string& host) const;
  // How long `bytes` take on the wire at the emulated bandwidth (zero when unlimited).
  absl::Duration WireTime(size_t bytes) const;
  // When a message of `bytes` that leaves now for `host` arrives there: after the link has
  // carried what was sent to it before, its own wire time, and the latency. `now` for a host
  // within the island.
  absl::Time Arrival(const std::string& host, size_t bytes, absl::Time now);

 private:
  const int island_;
  const DcnOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> islands_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, absl::Time> link_free_ ABSL_GUARDED_BY(mu_);  // per peer
};

}  // namespace pathways
