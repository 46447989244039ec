#include "collective/cross_host.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways::collective {
namespace {

// A ring step's receive is split into pieces of at most this size, each reduced as it lands.
constexpr size_t kChunkBytes = 256 << 10;

// `count` elements split into H contiguous, element-aligned segments.
Segments EvenSegments(char* buf, size_t count, size_t element, int hosts) {
  Segments segments(hosts);
  for (int h = 0; h < hosts; ++h) {
    const size_t begin = count * h / hosts, end = count * (h + 1) / hosts;
    if (end > begin) segments[h].push_back({buf + begin * element, (end - begin) * element});
  }
  return segments;
}

// `cur` is what this host holds so far: `in` until its first reduction writes `out`.
absl::Status RecursiveDoubling(MeshSteps& steps, DType dtype, ReduceOp op, const char* in, char* out, size_t count) {
  const size_t bytes = count * DTypeSize(dtype);
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  char* tmp = steps.mesh().Scratch(bytes);
  char* cur = const_cast<char*>(in);  // only ever sent from
  // Both partners of a step compute op(lower rank's value, higher rank's value): the same bits
  // on both, whatever the op.
  auto reduce = [&](int partner) {
    absl::Status s = partner < rank ? Reduce(dtype, op, tmp, cur, out, count) : Reduce(dtype, op, cur, tmp, out, count);
    cur = out;
    return s;
  };
  // Beyond the largest power of two p, the first 2r hosts pair up: even ones hand their data to
  // the next odd one, sit out the doubling, and get the result back at the end.
  int p = 1;
  while (p * 2 <= size) p *= 2;
  const int r = size - p;
  int new_rank = rank - r;
  if (rank < 2 * r) {
    std::vector<PeerTransfer> t(1);
    if (rank % 2 == 0) {
      t[0] = {rank + 1, {{cur, bytes}}, {}, nullptr};
      PW_RETURN_IF_ERROR(steps.Step(t));
      new_rank = -1;
    } else {
      t[0] = {rank - 1, {}, {{tmp, bytes}}, nullptr};
      PW_RETURN_IF_ERROR(steps.Step(t));
      PW_RETURN_IF_ERROR(reduce(rank - 1));
      new_rank = rank / 2;
    }
  } else if (r > 0) {
    std::vector<PeerTransfer> none;
    PW_RETURN_IF_ERROR(steps.Step(none));  // keeps step tags aligned with the paired hosts
  }
  for (int mask = 1; mask < p; mask <<= 1) {
    if (new_rank < 0) {
      std::vector<PeerTransfer> none;
      PW_RETURN_IF_ERROR(steps.Step(none));
      continue;
    }
    const int partner_new = new_rank ^ mask;
    const int partner = partner_new < r ? partner_new * 2 + 1 : partner_new + r;
    std::vector<PeerTransfer> t{{partner, {{cur, bytes}}, {{tmp, bytes}}, nullptr}};
    PW_RETURN_IF_ERROR(steps.Step(t));
    PW_RETURN_IF_ERROR(reduce(partner));
  }
  if (rank < 2 * r) {
    std::vector<PeerTransfer> t(1);
    if (rank % 2 == 0) {
      t[0] = {rank + 1, {}, {{out, bytes}}, nullptr};
    } else {
      t[0] = {rank - 1, {{out, bytes}}, {}, nullptr};
    }
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

int Mod(int x, int n) { return (x % n + n) % n; }

// A step that sends `out` to host `to` and receives `in` from host `from` (one transfer when
// they are the same host). The receiving transfer is the last.
std::vector<PeerTransfer> SendAndReceive(int to, std::vector<Piece> out, int from, std::vector<Piece> in) {
  if (to == from) return {{to, std::move(out), std::move(in), nullptr}};
  return {{to, std::move(out), {}, nullptr}, {from, {}, std::move(in), nullptr}};
}

// One ring step: `out` to the host after this one, `in` from the one before.
std::vector<PeerTransfer> RingStep(const PeerMesh& mesh, const std::vector<Piece>& out, const std::vector<Piece>& in) {
  return SendAndReceive(Mod(mesh.rank() + 1, mesh.size()), out, Mod(mesh.rank() - 1, mesh.size()), in);
}

// After H-1 steps, host h holds segment h reduced over all hosts. At step s host h sends segment
// h-s-1 (its partial sum so far) to h+1 and reduces segment h-s-2 arriving from h-1. Each
// segment is reduced at most once per host, so `out` is written from `inputs` (the same ranges
// of the input buffer) and what arrives, with no copy first; segment h-1 leaves from the input
// at step 0 and is not written here.
absl::Status RingReduceScatter(MeshSteps& steps, DType dtype, ReduceOp op, const Segments& inputs,
                               const Segments& segments) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  const size_t element = DTypeSize(dtype);
  size_t largest = 0;
  for (const auto& s : segments) largest = std::max(largest, TotalBytes(s));
  char* tmp = steps.mesh().Scratch(largest);
  const size_t chunk = std::max(element, kChunkBytes / element * element);
  for (int s = 0; s + 1 < size; ++s) {
    const int sent = Mod(rank - s - 1, size), landed = Mod(rank - s - 2, size);
    const auto& out = s == 0 ? inputs[sent] : segments[sent];
    // What arrives lands in tmp, one piece per chunk of each destination range.
    std::vector<Piece> landing;
    std::vector<const char*> from;
    std::vector<char*> into;
    size_t offset = 0;
    for (size_t k = 0; k < segments[landed].size(); ++k) {
      const Piece& range = segments[landed][k];
      for (size_t b = 0; b < range.bytes; b += chunk) {
        const size_t n = std::min(chunk, range.bytes - b);
        landing.push_back({tmp + offset, n});
        from.push_back(inputs[landed][k].data + b);
        into.push_back(range.data + b);
        offset += n;
      }
    }
    std::vector<PeerTransfer> t = RingStep(steps.mesh(), out, landing);
    t.back().on_piece = [&](size_t i) {
      return Reduce(dtype, op, from[i], landing[i].data, into[i], landing[i].bytes / element);
    };
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

// Host h starts with segment h; at step s it forwards segment h-s to h+1 and receives segment
// h-s-1 from h-1, in place.
absl::Status RingAllGather(MeshSteps& steps, const Segments& segments) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  for (int s = 0; s + 1 < size; ++s) {
    std::vector<PeerTransfer> t =
        RingStep(steps.mesh(), segments[Mod(rank - s, size)], segments[Mod(rank - s - 1, size)]);
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

// Rabenseifner's all_reduce for a power-of-two number of hosts: a reduce-scatter by recursive
// halving, then an all-gather by recursive doubling. Each host sends and receives what a ring's
// do (2(H-1)/H of the array) in 2 log2(H) steps instead of 2(H-1): fewer rounds in which a host
// waits for a peer to be scheduled, which is what a ring's large all_reduce pays for on hosts
// that share cores (collective_bench at 8 hosts on 2 cores; docs/benchmarks.md: 8% more steps/s
// than the ring there, the same within noise at 4, where it is kept for its fewer rounds). Each
// step of the first phase takes the next bit of the rank, highest first: a host keeps the half
// of its range on its side of that bit, sends the other half to the partner across it and
// reduces the partner's copy of its own half into `out`, chunk by chunk as it lands; the second
// phase undoes the splits, each host sending the range it holds reduced and receiving its
// partner's.
absl::Status HalvingDoubling(MeshSteps& steps, DType dtype, ReduceOp op, const char* in, char* out, size_t count) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  const size_t element = DTypeSize(dtype);
  const size_t chunk = std::max(element, kChunkBytes / element * element);
  struct Split {
    int partner;
    size_t kept_begin, kept_end, sent_begin, sent_end;  // elements
  };
  std::vector<Split> splits;
  char* tmp = steps.mesh().Scratch((count / 2 + 1) * element);
  size_t begin = 0, end = count;
  for (int mask = size / 2; mask >= 1; mask /= 2) {
    const int partner = rank ^ mask;
    const size_t mid = begin + (end - begin) / 2;
    const bool lower = (rank & mask) == 0;
    Split split{partner, lower ? begin : mid, lower ? mid : end, lower ? mid : begin, lower ? end : mid};
    // Until this host's first reduction its data is in `in`; after, its range is in `out`.
    const char* src = splits.empty() ? in : out;
    std::vector<Piece> landing;
    for (size_t b = split.kept_begin * element; b < split.kept_end * element; b += chunk) {
      landing.push_back({tmp + (b - split.kept_begin * element), std::min(chunk, split.kept_end * element - b)});
    }
    std::vector<PeerTransfer> t{
        {partner,
         {{const_cast<char*>(src) + split.sent_begin * element, (split.sent_end - split.sent_begin) * element}},
         landing,
         nullptr}};
    t[0].on_piece = [&, kept = split.kept_begin * element](size_t i) {
      const size_t at = kept + static_cast<size_t>(landing[i].data - tmp);
      // Lower rank's operand first, as recursive doubling does.
      return partner < rank ? Reduce(dtype, op, landing[i].data, src + at, out + at, landing[i].bytes / element)
                            : Reduce(dtype, op, src + at, landing[i].data, out + at, landing[i].bytes / element);
    };
    PW_RETURN_IF_ERROR(steps.Step(t));
    splits.push_back(split);
    begin = split.kept_begin;
    end = split.kept_end;
  }
  for (auto it = splits.rbegin(); it != splits.rend(); ++it) {
    std::vector<PeerTransfer> t{{it->partner,
                                 {{out + it->kept_begin * element, (it->kept_end - it->kept_begin) * element}},
                                 {{out + it->sent_begin * element, (it->sent_end - it->sent_begin) * element}},
                                 nullptr}};
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

// Appends the pieces of `from` that hold bytes. Whether a step sends a message at all is whether
// its piece list is empty (PeerTransfer), so both ends leave empty pieces out alike: each knows
// the step's byte count, not how the other cut it.
void AppendNonEmpty(std::vector<Piece>& to, const std::vector<Piece>& from) {
  for (const Piece& p : from) {
    if (p.bytes > 0) to.push_back(p);
  }
}

// Bruck's all_to_all. A block travels from its source s to s + d (d, its distance, from 1 to
// H-1) in the steps whose bit is set in d, and sits in slot d on every host it passes. So
// before step k (2^k = dist), slot d on host x holds the block from x - (d mod dist); at step k
// the slots with bit k set go to the host dist ahead and the same slots arrive from the host
// dist behind, in slot order on both sides. A block that is home lands in `recv`; one that is
// not is kept in scratch memory until its next hop (blocks leave from `send` the first time).
absl::Status BruckAllToAll(MeshSteps& steps, const std::vector<std::vector<Piece>>& send,
                           const std::vector<std::vector<Piece>>& recv,
                           absl::FunctionRef<size_t(int, int)> block_bytes) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  // What arrives at each step, planned first so that every relayed block has its place in one
  // scratch buffer: slot d's block, from `source`, home once no bit of d is above the step's.
  struct Arrival {
    int d;
    int source;
    size_t bytes;
    bool home;
  };
  std::vector<std::vector<Arrival>> arrivals;
  size_t relayed = 0;
  for (int dist = 1; dist < size; dist *= 2) {
    std::vector<Arrival>& step = arrivals.emplace_back();
    for (int d = dist; d < size; ++d) {
      if (!(d & dist)) continue;
      const int source = Mod(rank - (d & (2 * dist - 1)), size);
      step.push_back({d, source, block_bytes(source, Mod(source + d, size)), (d >> 1) < dist});
      if (!step.back().home) relayed += step.back().bytes;
    }
  }
  char* scratch = steps.mesh().Scratch(relayed);
  std::vector<std::vector<Piece>> slot(size);  // where slot d's block is now
  for (int d = 1; d < size; ++d) slot[d] = send[Mod(rank + d, size)];
  for (size_t k = 0; k < arrivals.size(); ++k) {
    const int dist = 1 << k;
    std::vector<Piece> out, in;
    std::vector<std::pair<int, Piece>> kept;  // slots relayed on, once this step is done
    for (const Arrival& a : arrivals[k]) {
      AppendNonEmpty(out, slot[a.d]);
      if (a.home) {
        AppendNonEmpty(in, recv[a.source]);
      } else {
        const Piece piece{scratch, a.bytes};
        scratch += a.bytes;
        AppendNonEmpty(in, {piece});
        kept.emplace_back(a.d, piece);
      }
    }
    std::vector<PeerTransfer> t =
        SendAndReceive(Mod(rank + dist, size), std::move(out), Mod(rank - dist, size), std::move(in));
    PW_RETURN_IF_ERROR(steps.Step(t));
    for (const auto& [d, piece] : kept) slot[d] = {piece};
  }
  return absl::OkStatus();
}

// Bruck's all_gather. Before step k (2^k = dist) host r holds the segments of hosts r to
// r + dist - 1; it sends the host dist behind as many of them as that host lacks, and gets as
// many from the host dist ahead, each straight into its place (every host lays segments out
// alike).
absl::Status BruckAllGather(MeshSteps& steps, const Segments& segments) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  for (int dist = 1; dist < size; dist *= 2) {
    std::vector<Piece> out, in;
    for (int i = 0; i < std::min(dist, size - dist); ++i) {
      const auto& mine = segments[Mod(rank + i, size)];
      const auto& theirs = segments[Mod(rank + dist + i, size)];
      out.insert(out.end(), mine.begin(), mine.end());
      in.insert(in.end(), theirs.begin(), theirs.end());
    }
    std::vector<PeerTransfer> t =
        SendAndReceive(Mod(rank - dist, size), std::move(out), Mod(rank + dist, size), std::move(in));
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

// A binomial tree from `root`: at step k (2^k = dist) the hosts within dist of the root (in
// ranks counted from it) send to the host dist further on. Every host takes every step, idle
// or not, so that step numbers agree.
absl::Status BinomialBroadcast(MeshSteps& steps, int root, char* buf, size_t bytes) {
  const int size = steps.mesh().size();
  const int me = Mod(steps.mesh().rank() - root, size);
  for (int dist = 1; dist < size; dist *= 2) {
    std::vector<PeerTransfer> t;
    if (me < dist && me + dist < size) t.push_back({Mod(me + dist + root, size), {{buf, bytes}}, {}, nullptr});
    if (me >= dist && me < 2 * dist) t.push_back({Mod(me - dist + root, size), {}, {{buf, bytes}}, nullptr});
    PW_RETURN_IF_ERROR(steps.Step(t));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AllReduceAcrossHosts(MeshSteps& steps, DType dtype, ReduceOp op, const char* in, char* out, size_t count) {
  const size_t element = DTypeSize(dtype);
  const int size = steps.mesh().size();
  if (count * element < kLargeMessageBytes || count < static_cast<size_t>(size)) {
    return RecursiveDoubling(steps, dtype, op, in, out, count);
  }
  if (size > 2 && (size & (size - 1)) == 0) return HalvingDoubling(steps, dtype, op, in, out, count);
  const Segments segments = EvenSegments(out, count, element, size);
  PW_RETURN_IF_ERROR(
      RingReduceScatter(steps, dtype, op, EvenSegments(const_cast<char*>(in), count, element, size), segments));
  return RingAllGather(steps, segments);
}

absl::Status ReduceScatterAcrossHosts(MeshSteps& steps, DType dtype, ReduceOp op, char* acc, size_t count,
                                      const Segments& segments) {
  if (count * DTypeSize(dtype) < kLargeMessageBytes) return RecursiveDoubling(steps, dtype, op, acc, acc, count);
  return RingReduceScatter(steps, dtype, op, segments, segments);
}

absl::Status AllGatherAcrossHosts(MeshSteps& steps, const Segments& segments, std::optional<SmallAlgorithm> small) {
  size_t total = 0;
  for (const auto& s : segments) total += TotalBytes(s);
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  if (total >= kLargeMessageBytes && size > 2) return RingAllGather(steps, segments);
  if (small.value_or(ChooseSmall(size)) == SmallAlgorithm::kLogRounds) return BruckAllGather(steps, segments);
  std::vector<PeerTransfer> t;
  for (int h = 0; h < size; ++h) {
    if (h != rank) t.push_back({h, segments[rank], segments[h], nullptr});
  }
  return steps.Step(t);
}

absl::Status BroadcastAcrossHosts(MeshSteps& steps, int root, char* buf, size_t bytes,
                                  std::optional<SmallAlgorithm> small) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  std::vector<PeerTransfer> t;
  if (bytes < kLargeMessageBytes || size <= 2) {
    if (small.value_or(ChooseSmall(size)) == SmallAlgorithm::kLogRounds) {
      return BinomialBroadcast(steps, root, buf, bytes);
    }
    // One round: the root sends to everyone.
    if (rank == root) {
      for (int h = 0; h < size; ++h) {
        if (h != root) t.push_back({h, {{buf, bytes}}, {}, nullptr});
      }
    } else {
      t.push_back({root, {}, {{buf, bytes}}, nullptr});
    }
    return steps.Step(t);
  }
  // Large: the root scatters one segment to each host, then a ring gathers them (the root sends
  // the data about once instead of H-1 times).
  const Segments segments = EvenSegments(buf, bytes, 1, size);
  if (rank == root) {
    for (int h = 0; h < size; ++h) {
      if (h != root && !segments[h].empty()) t.push_back({h, segments[h], {}, nullptr});
    }
  } else if (!segments[rank].empty()) {
    t.push_back({root, {}, segments[rank], nullptr});
  }
  PW_RETURN_IF_ERROR(steps.Step(t));
  return RingAllGather(steps, segments);
}

absl::Status AllToAllAcrossHosts(MeshSteps& steps, const std::vector<std::vector<Piece>>& send,
                                 const std::vector<std::vector<Piece>>& recv,
                                 absl::FunctionRef<size_t(int, int)> block_bytes, SmallAlgorithm algorithm) {
  const int size = steps.mesh().size(), rank = steps.mesh().rank();
  if (algorithm == SmallAlgorithm::kLogRounds) return BruckAllToAll(steps, send, recv, block_bytes);
  std::vector<PeerTransfer> t;
  for (int h = 0; h < size; ++h) {
    if (h != rank && (!send[h].empty() || !recv[h].empty())) t.push_back({h, send[h], recv[h], nullptr});
  }
  return steps.Step(t);
}

}  // namespace pathways::collective
