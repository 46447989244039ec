// CollectiveHub::Perform: once a host's members have met, combines their calls (copies and
// reductions in memory, shared out among them when large) and runs the cross-host part
// (cross_host.h) over the group's mesh.
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/collective.h"
#include "collective/collective_internal.h"
#include "collective/cross_host.h"
#include "collective/peer_mesh.h"
#include "collective/tcp_links.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

// Below this many bytes a host's members wait while the leader copies and reduces alone: waking
// threads to take parts costs more than the work. Measured with 4 members on one host
// (collective_bench --hub-only, 2 cores, 2026-12-05): shared out, a 4 MiB all_reduce ran 1.69x
// as many calls per second, a 256 KiB one the same, a 64 KiB one 0.65x.
constexpr size_t kShareBytes = size_t{512} << 10;

// Part p of n of [0, total), cut at multiples of 64 (elements or bytes: whole cache lines).
std::pair<size_t, size_t> PartOf(size_t total, int n, int p) {
  auto cut = [&](int q) { return q >= n ? total : (total * q / n) & ~size_t{63}; };
  return {cut(p), cut(p + 1)};
}

bool SameCall(const CollectiveCall& a, const CollectiveCall& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.count == b.count &&
         (a.kind != CollectiveKind::kBroadcast || a.root == b.root) &&
         (a.kind != CollectiveKind::kRoll || a.shift == b.shift) &&
         ((a.kind != CollectiveKind::kAllReduce && a.kind != CollectiveKind::kReduceScatter) || a.op == b.op);
}

// Appends [data, data+bytes) to `pieces`, merged with the last piece when adjacent.
void AddPiece(std::vector<Piece>& pieces, const char* data, size_t bytes) {
  char* p = const_cast<char*>(data);
  if (!pieces.empty() && pieces.back().data + pieces.back().bytes == p) {
    pieces.back().bytes += bytes;
  } else {
    pieces.push_back({p, bytes});
  }
}

}  // namespace

absl::Status CollectiveHub::Perform(const GroupPlacement& plan, const std::string& call_key, const CallId& id,
                                    const std::vector<const CollectiveCall*>& calls, Share share) {
  const size_t size = plan.group.shards.size();
  const bool cross = plan.hosts.size() > 1;

  // The local members must agree; the other hosts' agreement is checked by the signature every
  // message carries.
  const CollectiveCall& c = *calls[plan.local.front()];
  auto fail = [&](absl::StatusCode code, absl::string_view why) {
    return absl::Status(
        code, absl::StrCat("collective ", Describe(c), " ", plan.group.label, ", call ", call_key, ": ", why));
  };
  for (int r : plan.local) {
    if (!SameCall(*calls[r], c)) {
      // Found here alone: the other hosts are told why, not left to wait for this host until their
      // deadline. (What follows every host finds by itself.)
      const std::string why = absl::StrCat("members disagree: rank ", plan.local.front(), " calls ", Describe(c),
                                           ", rank ", r, " calls ", Describe(*calls[r]));
      if (cross && links_ != nullptr) {
        links_->Abandon(plan.hosts, plan.mine, plan.devices, id, absl::InvalidArgumentError(why));
      }
      return fail(absl::StatusCode::kInvalidArgument, why);
    }
  }
  const size_t element = DTypeSize(c.dtype);
  if (element == 0) return fail(absl::StatusCode::kInvalidArgument, "invalid dtype");
  const size_t bytes = c.count * element;
  if ((c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllToAll) && c.count % size != 0) {
    return fail(absl::StatusCode::kInvalidArgument,
                absl::StrCat(c.count, " elements do not split into ", size, " equal chunks"));
  }
  if (c.kind == CollectiveKind::kBroadcast && (c.root < 0 || c.root >= static_cast<int>(size))) {
    return fail(absl::StatusCode::kInvalidArgument,
                absl::StrCat("root ", c.root, " is not a member of a group of ", size));
  }
  if (cross && links_ == nullptr) {
    return fail(absl::StatusCode::kUnimplemented, absl::StrCat("host ", host_, " has no cross-host collectives"));
  }
  // What the members must agree on, as SameCall checks it locally.
  const bool reduces = c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter;
  const int64_t what[] = {static_cast<int64_t>(c.kind),
                          static_cast<int64_t>(c.dtype),
                          reduces ? static_cast<int64_t>(c.op) : -1,
                          c.kind == CollectiveKind::kBroadcast ? c.root : -1,
                          static_cast<int64_t>(c.count),
                          c.kind == CollectiveKind::kRoll ? c.shift : 0};
  const uint32_t signature =
      static_cast<uint32_t>(Fnv64(absl::string_view(reinterpret_cast<const char*>(what), sizeof(what))));
  // Runs the cross-host part on the group's mesh (connections are kept per set of devices).
  auto across = [&](auto&& body) -> absl::Status {
    absl::Status s = links_->Run(
        plan.hosts, plan.mine, plan.devices, id, absl::Now() + timeout_,
        [&](PeerMesh& mesh) {
          MeshSteps steps(mesh, id, signature, absl::Now() + timeout_);
          return body(steps);
        },
        [&] { return GoneStatus(call_key); });
    if (s.ok()) return s;
    return fail(s.code(), absl::StrCat("across hosts [", absl::StrJoin(plan.hosts, ", "), "]: ", s.message()));
  };
  // The ranges of a buffer of `size` chunks of `chunk` bytes that each host's members own.
  auto owned = [&](char* buf, size_t chunk) {
    Segments segments(plan.hosts.size());
    for (size_t r = 0; r < size; ++r) AddPiece(segments[plan.host_of[r]], buf + r * chunk, chunk);
    return segments;
  };
  const int first = plan.local.front();
  // Large calls share their local copies and reductions among this host's members: one part each.
  const int parts = plan.local.size() > 1 && bytes >= kShareBytes ? static_cast<int>(plan.local.size()) : 1;
  // Elements [from, from + n) of every local input, reduced into `out` (at least two members).
  auto reduce_inputs = [&](size_t from, size_t n, char* out) -> absl::Status {
    const size_t at = from * element;
    PW_RETURN_IF_ERROR(Reduce(c.dtype, c.op, calls[plan.local[0]]->in + at, calls[plan.local[1]]->in + at, out, n));
    for (size_t i = 2; i < plan.local.size(); ++i) {
      PW_RETURN_IF_ERROR(ReduceInto(c.dtype, c.op, out, calls[plan.local[i]]->in + at, n));
    }
    return absl::OkStatus();
  };
  // Every element of every local input reduced into `acc`, in parts shared out when large.
  auto reduce_all_into = [&](char* acc) {
    return share(parts, [&](int p) {
      const auto [lo, hi] = PartOf(c.count, parts, p);
      return reduce_inputs(lo, hi - lo, acc + lo * element);
    });
  };
  // The first member's output, `n` bytes at `src`, into every other local member's output.
  auto copy_out = [&](const char* src, size_t n) -> absl::Status {
    if (plan.local.size() == 1) return absl::OkStatus();
    return share(parts, [&](int p) {
      const auto [lo, hi] = PartOf(n, parts, p);
      for (size_t i = 1; i < plan.local.size(); ++i) std::memcpy(calls[plan.local[i]]->out + lo, src + lo, hi - lo);
      return absl::OkStatus();
    });
  };
  // One step in which this host swaps with each other host h the pieces `fill(h, t)` lists in
  // t.send and t.recv (hosts with nothing to swap exchange no message).
  auto swap_with_each_host = [&](const std::function<void(int h, PeerTransfer& t)>& fill) {
    return across([&](MeshSteps& s) {
      std::vector<PeerTransfer> transfers;
      for (int h = 0; h < static_cast<int>(plan.hosts.size()); ++h) {
        if (h == plan.mine) continue;
        PeerTransfer t;
        t.peer = h;
        fill(h, t);
        if (!t.send.empty() || !t.recv.empty()) transfers.push_back(std::move(t));
      }
      return s.Step(transfers);
    });
  };

  switch (c.kind) {
    case CollectiveKind::kAllReduce: {
      // The host's partial result: the only member's input as it is, or the local inputs reduced
      // into the first member's output.
      char* acc = c.out;
      const char* partial = c.in;
      if (plan.local.size() > 1) {
        PW_RETURN_IF_ERROR(reduce_all_into(acc));
        partial = acc;
      }
      if (cross) {
        PW_RETURN_IF_ERROR(
            across([&](MeshSteps& s) { return AllReduceAcrossHosts(s, c.dtype, c.op, partial, acc, c.count); }));
      } else if (partial != acc) {
        std::memcpy(acc, partial, bytes);  // a group of one
      }
      return copy_out(acc, bytes);
    }
    case CollectiveKind::kAllGather: {
      char* buf = c.out;
      for (int r : plan.local) std::memcpy(buf + r * bytes, calls[r]->in, bytes);
      if (cross) PW_RETURN_IF_ERROR(across([&](MeshSteps& s) { return AllGatherAcrossHosts(s, owned(buf, bytes)); }));
      return copy_out(buf, bytes * size);
    }
    case CollectiveKind::kReduceScatter: {
      const size_t chunk = bytes / size;
      if (!cross) {
        // Each member's chunk is reduced straight into its output (shared out, when large).
        if (plan.local.size() == 1) {
          std::memcpy(c.out, c.in + first * chunk, chunk);  // a group of one
          return absl::OkStatus();
        }
        auto by_member = [&](int p) {
          const int r = plan.local[p];
          return reduce_inputs(r * (c.count / size), c.count / size, calls[r]->out);
        };
        const int members = static_cast<int>(plan.local.size());
        return parts > 1 ? share(members, by_member) : Alone(members, by_member);
      }
      // The host's partial sums of every chunk, in memory this thread keeps for its next call
      // (a fresh buffer would be page-faulted in every time), up to 16 MiB: host memory outside
      // the device's budget, so a larger one is the call's alone.
      thread_local std::vector<char> kept;
      std::vector<char> once;
      std::vector<char>& room = bytes <= (size_t{16} << 20) ? kept : once;
      if (room.size() < std::max<size_t>(bytes, 1)) room.resize(std::max<size_t>(bytes, 1));
      char* acc = room.data();
      if (plan.local.size() == 1) {
        std::memcpy(acc, c.in, bytes);
      } else {
        PW_RETURN_IF_ERROR(reduce_all_into(acc));
      }
      PW_RETURN_IF_ERROR(across(
          [&](MeshSteps& s) { return ReduceScatterAcrossHosts(s, c.dtype, c.op, acc, c.count, owned(acc, chunk)); }));
      for (int r : plan.local) std::memcpy(calls[r]->out, acc + r * chunk, chunk);
      return absl::OkStatus();
    }
    case CollectiveKind::kAllToAll: {
      // Chunk j of member i becomes chunk i of member j's output.
      const size_t chunk = bytes / size;
      for (int i : plan.local) {
        for (int j : plan.local) std::memcpy(calls[j]->out + i * chunk, calls[i]->in + j * chunk, chunk);
      }
      if (!cross) return absl::OkStatus();
      // Host a's block for host b: chunk j of each member i on a, for each member j on b,
      // enumerated (i, j) by rank on every host, straight from the inputs into the outputs.
      const int hosts = static_cast<int>(plan.hosts.size());
      std::vector<size_t> members(hosts, 0);
      for (size_t r = 0; r < size; ++r) ++members[plan.host_of[r]];
      std::vector<std::vector<Piece>> send(hosts), recv(hosts);
      for (int i : plan.local) {
        for (size_t j = 0; j < size; ++j) {
          if (plan.host_of[j] != plan.mine) AddPiece(send[plan.host_of[j]], calls[i]->in + j * chunk, chunk);
        }
      }
      for (size_t i = 0; i < size; ++i) {
        if (plan.host_of[i] == plan.mine) continue;
        for (int j : plan.local) AddPiece(recv[plan.host_of[i]], calls[j]->out + i * chunk, chunk);
      }
      // The largest block is between the two hosts with the most members (never a host and itself).
      std::vector<size_t> most = members;
      std::partial_sort(most.begin(), most.begin() + 2, most.end(), std::greater<>());
      const SmallAlgorithm algorithm = ChooseAllToAll(hosts, most[0] * most[1] * chunk);
      return across([&](MeshSteps& s) {
        return AllToAllAcrossHosts(
            s, send, recv, [&](int a, int b) { return members[a] * members[b] * chunk; }, algorithm);
      });
    }
    case CollectiveKind::kBroadcast: {
      char* buf = calls[first]->out;
      if (plan.host_of[c.root] == plan.mine) std::memcpy(buf, calls[c.root]->in, bytes);
      if (cross) {
        PW_RETURN_IF_ERROR(
            across([&](MeshSteps& s) { return BroadcastAcrossHosts(s, plan.host_of[c.root], buf, bytes); }));
      }
      return copy_out(buf, bytes);
    }
    case CollectiveKind::kRoll: {
      // Member r gets member (r - shift) mod G's input: copied when both are on this host, else
      // straight from the sender's input into the receiver's output, one message per pair of
      // hosts that exchange, enumerated by the receiving rank on both sides.
      const int64_t n = static_cast<int64_t>(size);
      const int64_t shift = ((c.shift % n) + n) % n;
      auto source = [&](int64_t r) { return static_cast<int>((r - shift + n) % n); };
      for (int r : plan.local) {
        if (plan.host_of[source(r)] == plan.mine) std::memcpy(calls[r]->out, calls[source(r)]->in, bytes);
      }
      if (!cross) return absl::OkStatus();
      return swap_with_each_host([&](int h, PeerTransfer& t) {
        for (int64_t r = 0; r < n; ++r) {
          if (plan.host_of[r] == h && plan.host_of[source(r)] == plan.mine)
            AddPiece(t.send, calls[source(r)]->in, bytes);
        }
        for (int r : plan.local) {
          if (plan.host_of[source(r)] == h) AddPiece(t.recv, calls[r]->out, bytes);
        }
      });
    }
  }
  return fail(absl::StatusCode::kInvalidArgument, "unknown collective");
}

}  // namespace pathways::collective
