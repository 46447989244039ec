// The glossary of identifiers and orderings. Plain integers or strings on the wire; here the
// client's ids each have a type of their own (Id<Tag>: one kind cannot be passed for another)
// and a counter of their own where they are made; they become integers only at the wire.
//
// Identifiers
// - ClientId (string): a client, the hash of its credential (transport/auth.h). Everything a host
//   holds is keyed by it.
// - Incarnation (string): one worker or controller process; a restart at the same address is a
//   new one, and what the old one held is gone.
// - HostId, DeviceId: a worker process and a physical device, cluster-wide, from the controller
//   (int32 on the wire; counted from 0, the first host's and device's).
// - SliceId: a virtual slice of one client, from the controller; a mapping (client) is one
//   placement of it on physical devices, renewed when the slice is remapped.
// - ArrayId: a logical sharded array of one client; a run's outputs take a contiguous block.
// - LoweredProgramId: a program lowered for one placement of its inputs and registered on hosts
//   under this id (the traced form is a Program, the lowered form a ProgramProto/LoweredProgram,
//   the host-planned form a HostRuntime::HostProgram of NodePlans).
// - RunId: one call of Client::Run (or Call), for traces.
// - TracedProgramId: one traced Program (ProgramBuilder::Build), process-wide; lowerings are
//   cached by it and the placements of their inputs.
// - MappingId: one placement of a client's virtual slice; lowered programs name slices by it.
//
// Orderings, and what each orders
// - (session, seq): a client's ops on one host, in the client's order. A session is one
//   unbroken sequence; a new one starts when the old broke (the host restarted).
// - Epoch: one run op of one client, strictly increasing per client; also the run's epoch in
//   its program's dataflow graph, which tells a host when every block of the run has arrived.
//   The dataflow engine's epochs are plain integers: a program graph's are Epochs, an island
//   control graph's are rounds.
// - order: an island scheduler's runs on one host, 1, 2, 3, ... per pair of controller and host
//   incarnations: every device of the island runs gang work in this one order.
// - round: a batch of an island's scheduled ops in its control graph (one dataflow epoch),
//   numbered across generations.
// - generation: one membership of an island's control graph; it changes when hosts come or go.
#pragma once

#include <atomic>
#include <compare>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>

namespace pathways {

// An identifier of one kind: an integer on the wire, a type of its own here, so that an array id
// cannot be passed where a run id or an epoch is meant. For ids made here 0 is "none" and made
// ones start at 1; the controller's host and device ids count from 0.
template <typename Tag>
class Id {
 public:
  constexpr Id() = default;
  constexpr explicit Id(int64_t value) : value_(value) {}
  constexpr int64_t value() const { return value_; }
  // Consecutive ids (a run's outputs take a block of array ids).
  constexpr Id operator+(int64_t n) const { return Id(value_ + n); }
  friend constexpr auto operator<=>(Id, Id) = default;
  template <typename H>
  friend H AbslHashValue(H h, Id id) {
    return H::combine(std::move(h), id.value_);
  }
  friend std::ostream& operator<<(std::ostream& os, Id id) { return os << id.value_; }

 private:
  int64_t value_ = 0;
};

using ArrayId = Id<struct ArrayIdTag>;                    // one logical ShardedArray of a client
using RunId = Id<struct RunIdTag>;                        // one Client::Run or Call, for traces
using Epoch = Id<struct EpochTag>;                        // one run op of a client (see above)
using TracedProgramId = Id<struct TracedProgramIdTag>;    // one traced Program, process-wide
using LoweredProgramId = Id<struct LoweredProgramIdTag>;  // one lowering registered on hosts
using MappingId = Id<struct MappingIdTag>;                // one placement of a virtual slice
using SliceId = Id<struct SliceIdTag>;                    // one virtual slice of a client
using HostId = Id<struct HostIdTag>;                      // one worker process (controller's)
using DeviceId = Id<struct DeviceIdTag>;                  // one physical device, cluster-wide

// Process-unique, increasing ids of one kind, from 1. Thread-safe.
template <typename IdT>
class IdGenerator {
 public:
  IdT Next() { return IdT(next_.fetch_add(1, std::memory_order_relaxed)); }
  // The first of `n` consecutive ids.
  IdT Reserve(int64_t n) { return IdT(next_.fetch_add(n, std::memory_order_relaxed)); }

 private:
  std::atomic<int64_t> next_{1};
};

// A random 64-bit id, for names that must not collide across processes (client ids).
uint64_t RandomId64();
std::string RandomIdString();

// What status pages, metrics and timelines show of a client id: its first 8 digits, which a
// client recognises as its own. Ids alone grant nothing (calls for a client need its
// credential); this keeps them out of sight of other token holders anyway.
std::string ClientLabel(const std::string& client_id);

}  // namespace pathways
