// Collective algorithms among the hosts of a group, one leader thread per host, over a PeerMesh.
// Each host enters with its members' contributions already combined (see CollectiveHub), so
// these move host-level data only. The algorithm is chosen by size and group:
//   - small messages pay for rounds, not bytes: recursive doubling (all_reduce, reduce_scatter:
//     log2(H) rounds) or one round of direct sends (all_gather, broadcast);
//   - large ones pay for bytes: a ring (reduce-scatter then all-gather, each host sending
//     2(H-1)/H of the data), with what arrives reduced chunk by chunk while the rest streams in;
//     for all_reduce over a power of two of more than two hosts, the same bytes in 2 log2(H)
//     steps instead of 2(H-1) (recursive halving, then doubling).
// Shapes are static: every host knows every message's size, so no round exchanges sizes.
#pragma once

#include <cstdint>
#include <vector>

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

}  // namespace pathways::collective
