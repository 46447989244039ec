// Collective algorithms among the hosts of a group, one leader thread per host, over a PeerMesh.
// Each host enters with its members' contributions already combined (see CollectiveHub), so
// these move host-level data only. The algorithm is chosen by size and group:
//   - small messages pay for messages and rounds, not bytes: recursive doubling (all_reduce,
//     reduce_scatter: log2(H) rounds); over two or three hosts, one round of direct sends
//     (all_gather, broadcast, all_to_all), over more, ceil(log2 H) rounds of one message each
//     way (SmallAlgorithm);
//   - large ones pay for bytes: a ring (reduce-scatter then all-gather, each host sending
//     2(H-1)/H of the data), with what arrives reduced chunk by chunk while the rest streams in;
//     for all_reduce over a power of two of more than two hosts, the same bytes in 2 log2(H)
//     steps instead of 2(H-1) (recursive halving, then doubling).
// Shapes are static: every host knows every message's size, so no round exchanges sizes.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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
  // A step past the first that times out says so: in algorithms of several rounds a host may
  // wait for a peer that is itself waiting for the host that stopped, so the one named is not
  // always the culprit (that host's own error names the next one along).
  absl::Status Step(std::vector<PeerTransfer>& transfers) {
    const uint32_t step = step_++;
    absl::Status s = mesh_.Exchange(absl::MakeSpan(transfers), id_, step, signature_, deadline_);
    if (step == 0 || !absl::IsDeadlineExceeded(s)) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), " (in round ", step + 1,
                                               " of the call: a host named may be waiting for another in turn)"));
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

// How all_gather, broadcast and all_to_all move small messages between hosts.
//   - kDirect: one step in which every host sends each other host its part at once (the root,
//     for a broadcast): H-1 messages from each host.
//   - kLogRounds: ceil(log2 H) steps, each host sending at most one message per step (Bruck et
//     al., 1997). all_gather: at step k each host passes the 2^k segments it holds to the host
//     2^k behind, straight into their places, so every byte still moves once. broadcast: a
//     binomial tree, the hosts that have the data sending it 2^k further. all_to_all: each host
//     sends the host 2^k ahead every block whose distance to its destination has bit k set, and
//     relays what is not yet home: each byte is sent about log2(H)/2 times.
// Measured with `collective_bench --small-hosts 3,4,8,16`, hosts as threads on loopback, 2
// cores (docs/benchmarks.md "Small messages between hosts"): from 4 hosts the log rounds ran
// all_to_all and all_gather at 1.2-2.2x direct's calls/s, broadcast at about the same (the tree
// spares the root H-1 sends, which matters at more hosts); at 3 hosts they only add a round.
enum class SmallAlgorithm { kDirect, kLogRounds };
inline constexpr int kLogRoundsMinHosts = 4;
// all_to_all blocks larger than this go direct: the bytes Bruck's relays add cost more than the
// messages it saves (about equal at 64 KiB, 0.4-0.8x direct's rate at 1 MiB).
inline constexpr size_t kBruckMaxBlockBytes = 16 << 10;
// What each collective takes over `hosts` hosts (every host must take the same).
inline SmallAlgorithm ChooseSmall(int hosts) {
  return hosts >= kLogRoundsMinHosts ? SmallAlgorithm::kLogRounds : SmallAlgorithm::kDirect;
}
inline SmallAlgorithm ChooseAllToAll(int hosts, size_t largest_block) {
  return largest_block <= kBruckMaxBlockBytes ? ChooseSmall(hosts) : SmallAlgorithm::kDirect;
}

// Every host's segment, filled on that host, is copied to every other host: by `small` (or
// ChooseSmall) below kLargeMessageBytes in all (or over two hosts), by a ring from there.
absl::Status AllGatherAcrossHosts(MeshSteps& steps, const Segments& segments,
                                  std::optional<SmallAlgorithm> small = std::nullopt);

// `bytes` at `buf` on host `root` are copied to `buf` on every host: by `small` (or ChooseSmall)
// below kLargeMessageBytes (or over two hosts), by a scatter and a ring from there.
absl::Status BroadcastAcrossHosts(MeshSteps& steps, int root, char* buf, size_t bytes,
                                  std::optional<SmallAlgorithm> small = std::nullopt);

// Every host sends every other host a block. `send[h]` is this host's block for host h and
// `recv[h]` where host h's block for this host goes, as pieces (entries at this host's own rank
// are ignored). `block_bytes(a, b)` is the size of host a's block for host b, the same function
// on every host: blocks relayed through this host are sized by it. The caller chooses (see
// ChooseAllToAll), knowing the largest block without asking every pair.
absl::Status AllToAllAcrossHosts(MeshSteps& steps, const std::vector<std::vector<Piece>>& send,
                                 const std::vector<std::vector<Piece>>& recv,
                                 absl::FunctionRef<size_t(int, int)> block_bytes, SmallAlgorithm algorithm);

}  // namespace pathways::collective
