// The glossary of identifiers and orderings. Plain integers or strings on the wire; each has its
// own name here and its own counter where it is made.
//
// Identifiers
// - ClientId (string): a client, the hash of its credential (transport/auth.h). Everything a host
//   holds is keyed by it.
// - Incarnation (string): one worker or controller process; a restart at the same address is a
//   new one, and what the old one held is gone.
// - HostId, DeviceId: a worker process and a physical device, cluster-wide, from the controller.
// - SliceId: a virtual slice of one client (controller); a mapping (client) is one placement of
//   it on physical devices, renewed when the slice is remapped.
// - ArrayId: a logical sharded array of one client; a run's outputs take a contiguous block.
// - LoweredProgramId: a program lowered for one placement of its inputs and registered on hosts
//   under this id (the traced form is a Program, the lowered form a ProgramProto/LoweredProgram,
//   the host-planned form a HostRuntime::Program of NodePlans).
// - RunId: one call of Client::Run (or Call), for traces.
//
// Orderings, and what each orders
// - (session, seq): a client's ops on one host, in the client's order. A session is one
//   unbroken sequence; a new one starts when the old broke (the host restarted).
// - Epoch: one run op of one client, strictly increasing per client; also the run's epoch in
//   its program's dataflow graph, which tells a host when every block of the run has arrived.
// - order: an island scheduler's runs on one host, 1, 2, 3, ... per pair of controller and host
//   incarnations: every device of the island runs gang work in this one order.
// - round: a batch of an island's scheduled ops in its control graph (one dataflow epoch),
//   numbered across generations.
// - generation: one membership of an island's control graph; it changes when hosts come or go.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace pathways {

using ArrayId = int64_t;     // one logical ShardedArray, unique within its client
using LoweredProgramId = int64_t;
using RunId = int64_t;
using Epoch = int64_t;
using HostId = int32_t;      // one worker process, assigned by the controller
using DeviceId = int32_t;    // one physical device, cluster-wide, assigned by the controller

// Process-unique, monotonically increasing ids. Thread-safe.
class IdGenerator {
 public:
  explicit IdGenerator(int64_t first = 1) : next_(first) {}
  int64_t Next() { return next_.fetch_add(1, std::memory_order_relaxed); }
  // The first of `n` consecutive ids.
  int64_t Reserve(int64_t n) { return next_.fetch_add(n, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> next_;
};

// A random 64-bit id, for names that must not collide across processes (client ids).
uint64_t RandomId64();
std::string RandomIdString();

}  // namespace pathways
