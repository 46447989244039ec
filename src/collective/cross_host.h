// Collective algorithms among the hosts of a group, one leader thread per host, over a PeerMesh.
// Each host enters with its members' contributions already combined (see CollectiveHub), so
// these move host-level data only. The algorithm is chosen by size and group:
//   - small messages pay for rounds, not bytes: recursive doubling (all_reduce, reduce_scatter:
//     log2(H) rounds) or one round of direct sends (all_gather, broadcast);
//   - all_to_all: Bruck's algorithm for small blocks over many hosts (log2(H) rounds of one
//     message each way, relaying blocks), one round of direct swaps otherwise;
//   - large ones pay for bytes: a ring (reduce-scatter then all-gather, each host sending
//     2(H-1)/H of the data), with what arrives reduced chunk by chunk while the rest streams in;
//     for all_reduce over a power of two of more than two hosts, the same bytes in 2 log2(H)
//     steps instead of 2(H-1) (recursive halving, then doubling).
// Shapes are static: every host knows every message's size, so no round exchanges sizes.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "collective/peer_mesh.h"
#include "collective/reduction.h"
#include "core/types.h"

namespace pathways::collective {

// Messages at least this large take the bandwidth-optimal algorithms. Measured with
// `collective_bench --hub-only true` on loopback, 4 and 8 hosts: at 64 and 128 KiB recursive
// doubling matched or beat the ring (2740 against 1534 all_reduces/s at 8 hosts, 64 KiB), at
// 256 KiB the ring won (about 1000 against 800). Below it the extra rounds of a ring cost more
// than the bytes recursive doubling repeats.
inline constexpr size_t kLargeMessageBytes = 256 << 10;

// The steps of one collective call on a mesh: each step's messages carry the call and the step.
class MeshSteps {
 public:
  MeshSteps(PeerMesh& mesh, CallId id, uint32_t signature, absl::Time deadline)
      : mesh_(mesh), id_(id), signature_(signature), deadline_(deadline) {}
  PeerMesh& mesh() { return mesh_; }
  absl::Status Step(std::vector<PeerTransfer>& transfers) {
    return mesh_.Exchange(absl::MakeSpan(transfers), id_, step_++, signature_, deadline_);
  }

 private:
  PeerMesh& mesh_;
  const CallId id_;
  const uint32_t signature_;
  const absl::Time deadline_;
  uint32_t step_ = 0;
};

// The parts of a buffer each host owns, by host rank (a host's members' chunks need not be
// contiguous, so a segment is a list of ranges).
using Segments = std::vector<std::vector<Piece>>;

// `count` elements at `out` become the reduction of `in` over every host, identical on every
// host. `in` may be `out`; otherwise it is read, never copied to `out` first.
absl::Status AllReduceAcrossHosts(MeshSteps& steps, DType dtype, ReduceOp op, const char* in, char* out, size_t count);

// Each host's segment of `acc` becomes the reduction of that segment over every host (the rest
// of `acc` is left partly reduced). Segments hold whole elements.
absl::Status ReduceScatterAcrossHosts(MeshSteps& steps, DType dtype, ReduceOp op, char* acc, size_t count,
                                      const Segments& segments);

// Every host's segment, filled on that host, is copied to every other host.
absl::Status AllGatherAcrossHosts(MeshSteps& steps, const Segments& segments);

// `bytes` at `buf` on host `root` are copied to `buf` on every host.
absl::Status BroadcastAcrossHosts(MeshSteps& steps, int root, char* buf, size_t bytes);

// How an all_to_all between hosts moves its blocks.
//   - kDirect: one step in which each host swaps blocks with every other host: H-1 messages each
//     way per host, every byte sent once.
//   - kBruck (Bruck et al., 1997): ceil(log2 H) steps; in step k each host sends one message to
//     the host 2^k ahead, holding every block whose distance to its destination has bit k set
//     (about half of them), and relays what is not yet home: log2(H) messages per host, each
//     byte sent about log2(H)/2 times.
enum class AllToAllAlgorithm { kDirect, kBruck };
// Bruck's algorithm is chosen over at least this many hosts, when no block is larger than
// kBruckMaxBlockBytes. Measured with `collective_bench --all-to-all-hosts 3,4,8,16`, hosts as
// threads on loopback, 2 cores (docs/benchmarks.md "all_to_all between hosts"): Bruck ran 1.3-2x
// direct's calls/s at 4 to 16 hosts for blocks up to 16 KiB, about equal at 3 hosts, and
// 0.4-0.9x for blocks of 64 KiB and more, where its relayed bytes cost more than the messages it
// saves.
inline constexpr int kBruckMinHosts = 4;
inline constexpr size_t kBruckMaxBlockBytes = 16 << 10;
// Which is faster for `hosts` hosts whose largest block is `largest_block` bytes (every host must
// pick the same).
inline AllToAllAlgorithm ChooseAllToAll(int hosts, size_t largest_block) {
  return hosts >= kBruckMinHosts && largest_block <= kBruckMaxBlockBytes ? AllToAllAlgorithm::kBruck
                                                                         : AllToAllAlgorithm::kDirect;
}

// Every host sends every other host a block. `send[h]` is this host's block for host h and
// `recv[h]` where host h's block for this host goes, as pieces (entries at this host's own rank
// are ignored). `block_bytes(a, b)` is the size of host a's block for host b, the same function
// on every host: blocks relayed through this host are sized by it.
absl::Status AllToAllAcrossHosts(MeshSteps& steps, const std::vector<std::vector<Piece>>& send,
                                 const std::vector<std::vector<Piece>>& recv,
                                 absl::FunctionRef<size_t(int, int)> block_bytes, AllToAllAlgorithm algorithm);

}  // namespace pathways::collective
