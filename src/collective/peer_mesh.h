// The message layer between the hosts of a collective group (over connections that tcp_links.h
// makes and keeps), and the one primitive the cross-host algorithms are written in: a step in
// which this host sends at most one message to each peer and receives at most one from each, all
// progressed at once.
//
// Why not Gloo (which the runtime used before): Gloo's TCP pairs complete every receive on the
// device's event-loop thread and hand it to the waiting thread, two thread switches per message,
// and its allgatherv needed a first round to learn sizes. Our shapes are static, so a message
// needs no size round, and the thread that runs the collective (the host's leader for that call,
// a device thread) does its own non-blocking socket I/O and sleeps in poll() only when nothing
// can move. Measured in bench/collective_bench (docs/benchmarks.md).
//
// Why not UCX (Debian's libucx, through OpenMPI's pml ucx, measured in the same benchmark,
// docs/benchmarks.md "UCX"): over TCP, the only transport between machines without RDMA, its
// 4 MiB all_reduce ran at 0.51-0.77 of OpenMPI's own TCP transport at 4 and 8 processes (about
// equal at 2), where ours ran at 0.82-1.06. Its scalars were 1.2-1.6x faster than OpenMPI's
// TCP, so a scalar step is
// where our own path has room, not a reason to move ours onto it; what UCX adds (RDMA, shared
// memory across processes) does not exist between our hosts here, and our members on one host
// already share memory in one process.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "collective/collective.h"
#include "core/dcn_emulation.h"

namespace pathways::collective {

// Memory a message is sent from or received into. Does not own it.
struct Piece {
  char* data = nullptr;
  size_t bytes = 0;
};

inline size_t TotalBytes(const std::vector<Piece>& pieces) {
  size_t n = 0;
  for (const Piece& p : pieces) n += p.bytes;
  return n;
}

// Which collective call a message belongs to: the gang execution (client, program, run, node
// and group; hashed) and the call's index in it. The same on every member. `run` names the
// execution's run (client, program and run; hashed): a host that never started the run drops its
// messages and says why when asked (TcpLinks::RunNotStarted). 0: none.
struct CallId {
  uint64_t execution = 0;
  uint32_t call = 0;
  uint64_t run = 0;
  bool operator==(const CallId& o) const { return execution == o.execution && call == o.call; }
};

// What precedes every message on a mesh's connections. Hosts of one cluster share a byte order.
struct MessageHeader {
  uint32_t magic;
  uint32_t signature;
  uint64_t execution;  // CallId
  uint32_t call;
  uint32_t step;
  uint64_t bytes;
  // Emulated DCN only: when the message may be taken as delivered (Unix microseconds; hosts
  // that emulate share one machine's clock). 0: at once.
  int64_t deliver_us;
  uint64_t run;  // CallId
};

// One peer's part of a step: the message sent to it (the concatenation of `send`) and the one
// received from it (scattered over `recv`). Either may be empty (no message that way).
struct PeerTransfer {
  int peer = -1;
  std::vector<Piece> send;
  std::vector<Piece> recv;
  // Called once recv[i] has arrived, pieces in order, on the calling thread: a step's receive
  // can be reduced chunk by chunk while the rest of it is still on the wire.
  std::function<absl::Status(size_t i)> on_piece;
};

// Connections from this host to every other host of a group, for one set of member devices.
// Not thread-safe: TcpLinks::Run lends it to one collective at a time.
class PeerMesh {
 public:
  // `dcn`, when not null, delays messages between islands (core/dcn_emulation.h).
  PeerMesh(std::vector<std::string> hosts, int rank, DcnEmulation* dcn = nullptr);
  ~PeerMesh();
  PeerMesh(const PeerMesh&) = delete;
  PeerMesh& operator=(const PeerMesh&) = delete;

  // How often (milliseconds) a call that waits for a peer looks whether the peer left the island
  // or withdrew from the call (StillComing).
  static constexpr int kCheckPeersMs = 250;

  int size() const { return static_cast<int>(hosts_.size()); }
  int rank() const { return rank_; }
  const std::string& host(int r) const { return hosts_[r]; }

  // Sends and receives every transfer's messages, all progressing together, until each is done
  // or `deadline` passes. Every message names its call and step (`id`, `step`) and carries
  // `signature` (what is being reduced or gathered: kind, dtype, sizes); another signature or
  // size for the same call fails with InvalidArgument. Errors name the peer host.
  //
  // Hosts can fall out of step: a run that failed on one host before a collective, gangs ordered
  // differently. A message of an execution this host is done with is a lagging peer's, and one of
  // a run this host never started (not_started_) will never be wanted here: both are dropped.
  // A message of a call this host has not reached means the peer is past this call: the message
  // is kept for its call (the last 64 per peer, for at most 5 minutes), this call is abandoned
  // with Aborted (every message already started is finished first, so the connection stays
  // usable) and the caller moves on. Both hosts then meet again at the next call they share,
  // instead of failing every call after.
  absl::Status Exchange(absl::Span<PeerTransfer> transfers, CallId id, uint32_t step, uint32_t signature,
                        absl::Time deadline);

  // A call on this mesh failed here with `status` (not Aborted). NoticeOf is what tells a peer
  // why: the host where the failure began and the cause (a failure that came in a peer's notice
  // is passed on as it came). Fail sends it on every connection where no message to the peer was
  // cut off, and closes those left part way through a message either way, or closed by the peer,
  // and with `close_unseen` those of peers not heard from in this call (see the .cc). The others
  // stay. A peer waiting for this host in the call fails with the same code and cause,
  // and passes it on when it fails in turn (in algorithms of several rounds most hosts wait for
  // one that was itself waiting); a peer already past the call drops it, as any message of a call
  // it is done with. Both then meet at their next call without reconnecting: a failure does not
  // spill into the next call.
  std::string NoticeOf(const absl::Status& status) const;
  void Fail(const std::string& notice, bool close_unseen);

  // Working memory for the algorithms, at least `bytes`, kept across calls: a fresh buffer per
  // call would be page-faulted in every time.
  char* Scratch(size_t bytes);

  // For tests: the connection to peer `r` (-1 when there is none), to write what a broken peer
  // would.
  int TEST_fd(int r) const { return fds_[r]; }

 private:
  friend class TcpLinks;
  struct Stashed {  // a later call's message, read early
    MessageHeader header;
    std::string payload;
    absl::Time at;
  };
  void CloseAll();
  void Enter(CallId id);  // a call starts: the executions before it are done
  // This host is done with `execution`: it `entered` it, or its members withdrew before.
  void Past(uint64_t execution, bool entered);
  // Why peer `r`, which this call has waited for a while, will not come: it left the island
  // (departed_), or it says it withdrew from the call (ask_withdrawn_, asked at growing intervals).
  // OK while it may still come.
  absl::Status StillComing(int r, absl::Time deadline);
  // The failure a notice of this call from peer `r` (header `h`, payload `body`) brings, kept to
  // be passed on.
  absl::Status Relay(int r, const MessageHeader& h, const std::string& body);
  // Reads the rest of a notice from peer `r` on `fd` (the first `got` bytes of its header are
  // in `h`; the peer wrote it whole just before closing, so this waits at most a second). Of this
  // call: the peer's failure, kept to be passed on. Of another: Unavailable, saying what the peer
  // had failed. No whole notice: `otherwise`.
  absl::Status TakeNotice(int r, int fd, MessageHeader& h, size_t got, absl::Status otherwise, absl::Time deadline);
  // A connection to peer `r` that the peer has closed. If the peer was in this execution, what it
  // sent before it failed is still to be read: messages, taken as any others (true), then a
  // notice, or a notice first (its failure, returned). Otherwise (a connection of a call that
  // failed before this one): false, and the two reconnect.
  absl::StatusOr<bool> KeepClosed(int r, int fd, absl::Time deadline);
  // Whether `h` is of a call this host is done with (before step `step` of call `id`), or of a
  // run it never started (not_started_): such messages are dropped.
  bool Stale(const MessageHeader& h, CallId id, uint32_t step) const;

  const std::vector<std::string> hosts_;
  const int rank_;
  uint64_t key_hash_ = 0;  // Fnv64 of the key TcpLinks holds it by (TcpLinks::Withdrew)
  DcnEmulation* const dcn_;
  // Why a call cannot go on with peer host `h` (it left the island, or this host is stopping),
  // OK when it can; looked at while a call waits for a peer (TcpLinks::SetDeparted, StopWaiting).
  // Null: never.
  std::function<absl::Status(const std::string& h)> departed_;
  // Asks peer host `h` whether it withdrew from call `id` (TcpLinks::AskWithdrawn). Null: never.
  std::function<absl::Status(const std::string& h, CallId id, absl::Time deadline)> ask_withdrawn_;
  // Whether this host never started run `run` (CallId::run; TcpLinks::RunNotStarted): its
  // messages are dropped as those of a call this host is done with. Null: none.
  std::function<bool(uint64_t run)> not_started_;
  // Whether this host still wants the current call (TcpLinks::Run's `wanted`, set for the call).
  // Null, or an empty function: always.
  const std::function<absl::Status()>* wanted_ = nullptr;
  std::vector<int> fds_;                   // by peer rank; -1 when not connected (and at rank_)
  uint64_t dial_ins_seen_ = ~uint64_t{0};  // TcpLinks::dial_ins_ when we last took ours
  std::vector<char> scratch_;
  // By peer rank: in a failed call, a message to it (kCutOut) or from it (kCutIn) stopped part way.
  static constexpr uint8_t kCutOut = 1, kCutIn = 2;
  std::vector<uint8_t> cut_;
  std::vector<bool> seen_;      // by peer rank: something of the current execution came from it
  CallId asks_for_;             // the call next_ask_ and ask_interval_ are of
  std::vector<absl::Time> next_ask_;          // by peer rank
  std::vector<absl::Duration> ask_interval_;  // by peer rank: the last wait between asks
  absl::Time next_ask_any_;                   // no ask of any peer before
  std::string relayed_origin_;  // the failure the last notice from a peer brought, to pass on
  std::string relayed_cause_;
  // The peer that said it withdrew from the failed call (or a notice said so); empty if none did.
  std::string withdrew_;
  std::vector<std::deque<Stashed>> stash_;  // by peer rank, in arrival order
  CallId current_;
  // Executions done here, the last kPastExecutions: whether this host entered each (a peer's
  // connection dialed for one it did not enter was never taken here, and the peer may use it still).
  absl::flat_hash_map<uint64_t, bool> past_;
  std::deque<uint64_t> past_order_;
  absl::Mutex mu_;  // held by the collective that uses the mesh
};

}  // namespace pathways::collective
