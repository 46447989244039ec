// Persistent TCP connections between hosts: one host's listener, its collective meshes
// (peer_mesh.h) and point-to-point streams (block_streams.h), connected through the rendezvous
// store and reconnected after failures. The listener, handshake and streams are in
// tcp_links.cc; connecting, running and failing a mesh's calls in tcp_links_meshes.cc.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "collective/collective.h"
#include "collective/peer_mesh.h"
#include "core/dcn_emulation.h"

namespace pathways::collective {

// Calls this host will not make (CollectiveHub::Withdraw): in a group that spans hosts and has no
// member left here, the calls of `execution` (a CallId's) from `from_call` on, for `why`.
struct Withdrawal {
  uint64_t execution = 0;
  uint32_t from_call = 0;
  uint64_t mesh = 0;  // the group's mesh: Fnv64 of its key (GroupPlacement::devices)
  absl::Status why;
};

// One host's endpoint for collectives across hosts: a listening socket whose address is published
// in the rendezvous store, and one PeerMesh per set of member devices, kept across calls (a later
// gang on the same devices reuses its connections). Within a pair of hosts the one later in the
// group's host order dials. A call that fails tells the peers why (PeerMesh::Fail) and closes
// only the connections it left part way through a message; peers see a close before their next
// use and reconnect, so hosts that failed together meet again. Thread-safe.
class TcpLinks {
 public:
  // Listens on `ip`, at `port` (0: one the kernel chooses). `host` is this host's name in Member::host.
  // `dcn` (not owned, may be null) emulates the network between islands. Both ends of every
  // connection prove that they hold `secret` (the cluster token) without sending it: each sends a
  // random challenge and answers the other's with an HMAC-SHA256 under the secret (see Proof in
  // tcp_links.cc). A connection that fails either proof is closed. The traffic itself is not
  // encrypted.
  static absl::StatusOr<std::unique_ptr<TcpLinks>> Create(std::string host, const std::string& ip,
                                                          std::shared_ptr<KeyValueStore> store,
                                                          DcnEmulation* dcn = nullptr, std::string secret = "",
                                                          int port = 0);
  ~TcpLinks();

  // Connects (or reuses) the mesh among `hosts` (this host is hosts[rank]) for the devices named
  // by `key`, and runs `body`, collective call `id`, on it, holding it for the call. On any
  // failure the peers are told why (Failed). Errors of the connection itself name the hosts.
  // `wanted`, when given, is asked whenever the call has waited for a peer a while (to connect,
  // or for its message: PeerMesh::kCheckPeersMs): an error ends the call with it.
  absl::Status Run(const std::vector<std::string>& hosts, int rank, const std::string& key, CallId id,
                   absl::Time deadline, absl::FunctionRef<absl::Status(PeerMesh&)> body,
                   const std::function<absl::Status()>& wanted = nullptr);

  // A call that failed on this host before it reached the mesh (its members here disagree, say):
  // the peers are told as if it had failed on the mesh. Those this host dials and is not
  // connected to are dialed (for two seconds at most); it waits for none to dial in.
  void Abandon(const std::vector<std::string>& hosts, int rank, const std::string& key, CallId id,
               const absl::Status& status);

  // What this host's withdrawn gang members leave undone (Withdrawal): a peer that waits for this
  // host in one of those calls asks (AskWithdrawn) and fails at once with why, instead of at its
  // deadline; what it sent this host for that execution is dropped here at the next call on the
  // group's mesh, as a call this host is done with. The last 4096 are remembered.
  // Peers find a host that has published its address (Publish; workers do as they start).
  void Withdrew(std::vector<Withdrawal> withdrawals);
  // This host will make none of run `run`'s calls (CallId::run): it failed before any of its
  // shards here was set up (its program never reached this host, or failed to register), so no
  // member here withdraws by name. What peers send for the run is dropped here as of calls this
  // host is done with (a peer's message would otherwise read as a later call's and fail the call
  // it came in: another client's, perhaps), and a peer that waits for this host in one of its
  // calls and asks is told `why`. `client` names the run's client (a hash): 4096 runs are
  // remembered, and when there are more the client that holds the most loses its oldest, so
  // clients that fail their runs here on purpose push out only their own.
  void RunNotStarted(uint64_t run, uint64_t client, const absl::Status& why);
  // Whether `peer` will make call `id`: its why (the code it gave, never OK or Aborted) when it
  // withdrew from it; OK when it did not, or did not answer by `deadline` (the call waits on, for
  // the controller to say whether the peer left).
  absl::Status AskWithdrawn(const std::string& peer, CallId id, absl::Time deadline);

  // Point-to-point streams beside the meshes: a connection dialed in with hello `key` goes to
  // `handler`, which takes the descriptor (on the listener's thread: it must not block). A null
  // handler stops taking them, once any call in progress has returned.
  void AcceptStreams(const std::string& key, std::function<void(int fd, const std::string& peer)> handler);
  // Dials `peer` for a stream named `key` (publishing this host first); the caller owns the
  // descriptor (non-blocking, TCP_NODELAY).
  absl::StatusOr<int> DialStream(const std::string& peer, const std::string& key, absl::Time deadline);

  // The host is going: meshes waiting for peers to connect (or dialing them), and exchanges
  // waiting for a peer's message, stop waiting, now and from now on (Cancelled; an exchange
  // within PeerMesh::kCheckPeersMs): a worker told to stop is not held by a collective.
  void StopWaiting();
  // The hosts that left the island (frozen past the heartbeat timeout, gone), with why, as the
  // controller last said: replaces what was set before. A call over one of them fails at once,
  // and calls waiting to connect to one stop waiting (Unavailable, naming it and why), instead
  // of each holding its devices until the collective timeout. Exchanges already connected end by
  // their own deadlines.
  void SetDeparted(absl::flat_hash_map<std::string, std::string> why);
  // These hosts are live again (a new worker at a departed host's address, say), until the next
  // SetDeparted names them.
  void Returned(const std::vector<std::string>& hosts);

  // Publishes this host's address in the rendezvous store (again: a restarted store forgot it).
  // Meshes and streams publish on first use; a host that only receives calls this once it can
  // reach the store.
  absl::Status Publish();

  const std::string& address() const { return address_; }

  // A connection a peer dialed in for a mesh, and the call it dialed for.
  struct DialIn {
    int fd;
    CallId id;
  };

 private:
  TcpLinks(std::string host, int listen_fd, int wake_fd, std::string address, std::shared_ptr<KeyValueStore> store,
           DcnEmulation* dcn, std::string secret);
  absl::Status Connect(PeerMesh& mesh, const std::string& key, absl::Time deadline);
  // Dials `peer` for `key`, for collective call `id` (none for a stream).
  absl::StatusOr<int> Dial(const std::string& peer, const std::string& key, CallId id, absl::Time deadline);
  std::shared_ptr<PeerMesh> MeshFor(const std::vector<std::string>& hosts, int rank, const std::string& key);
  // The mesh's call (the caller holds the mesh) failed with `status`: the peers are told why,
  // those that dial in for it later too (PeerMesh::Fail, failed_calls_).
  void Failed(PeerMesh& mesh, const std::string& key, const absl::Status& status);
  // The connection peer `p` of `mesh` dials in for `key`.
  absl::StatusOr<int> AwaitDialIn(PeerMesh& mesh, int p, const std::string& key, absl::Time deadline);
  // The connection peer `p` of `mesh` dialed in for the mesh's call, else (unless
  // `only_this_call`) the newest it dialed for another and still holds; -1 when none. Drops those
  // dialed for calls the mesh is done with.
  int TakeDialIn(PeerMesh& mesh, int p, const std::string& key, bool only_this_call = false);
  absl::Status EnsurePublished();
  // Accepts connections and reads their hellos side by side (see PendingHello in the .cc).
  void AcceptLoop();
  // Checks a complete hello (`received`, after the listener's `challenges`) and answers with this
  // host's proof; fills the hello's key and host.
  absl::Status FinishHello(int fd, absl::Time deadline, std::string challenges, const std::string& received,
                           std::string& key, std::string& peer, CallId& id);
  // A proven connection: to its stream handler, or to the meshes' dialed-in connections.
  void TakeConnection(int fd, std::string key, std::string peer, CallId id);
  // The hello key of a connection that asks whether this host withdrew from a call (its id).
  static constexpr char kAskWithdrawnKey[] = "#withdrawn?";
  // Answers a peer's AskWithdrawn on `fd` for call `id`, and closes it.
  void AnswerWithdrawn(int fd, CallId id);

  const std::string host_;
  const int listen_fd_;
  const int wake_fd_;
  const std::string address_;
  const std::shared_ptr<KeyValueStore> store_;
  DcnEmulation* const dcn_;
  const std::string secret_;
  std::thread acceptor_;
  std::atomic<bool> published_{false};
  // Counts connections dialed in: a mesh looks for newer connections only when it moved.
  std::atomic<uint64_t> dial_ins_{0};

  // Taken while a stream handler runs, so that removing one waits for it.
  absl::Mutex handlers_mu_;
  absl::flat_hash_map<std::string, std::function<void(int, const std::string&)>> stream_handlers_
      ABSL_GUARDED_BY(handlers_mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_waiting_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::string> departed_ ABSL_GUARDED_BY(mu_);  // host -> why
  // Why a call over `peer` cannot go on: it left the island (OK when it did not).
  absl::Status DepartedLocked(const std::string& peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<PeerMesh>> meshes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> addresses_ ABSL_GUARDED_BY(mu_);  // peer host -> ip:port
  // Connections dialed in, by (key, peer host), not yet taken by a mesh, with the call each was
  // dialed for (a peer ahead of this host may have dialed for several).
  absl::flat_hash_map<std::pair<std::string, std::string>, std::vector<DialIn>> dialed_in_ ABSL_GUARDED_BY(mu_);
  size_t waiting_dial_ins_ ABSL_GUARDED_BY(mu_) = 0;  // in all of dialed_in_
  // The last calls that failed on each mesh (by key), with the notices that say why.
  struct FailedCall {
    CallId id;
    std::string notice;
  };
  absl::flat_hash_map<std::string, std::deque<FailedCall>> failed_calls_ ABSL_GUARDED_BY(mu_);
  // Withdrew's records by execution (oldest first in withdrawal_order_), and the executions each
  // mesh is to count as past at its next call (oldest first in withdrawn_mesh_order_).
  struct Withdrawn {
    uint32_t from_call;
    absl::Status why;
  };
  absl::flat_hash_map<uint64_t, Withdrawn> withdrawals_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> withdrawal_order_ ABSL_GUARDED_BY(mu_);
  // RunNotStarted's records by run, and each client's runs oldest first (seq: the order of all
  // records); not_started_count_ lets meshes skip the lock while there are none.
  struct NotStarted {
    absl::Status why;
    uint64_t client;
  };
  struct ClientRun {
    uint64_t run;
    uint64_t seq;
  };
  absl::flat_hash_map<uint64_t, NotStarted> not_started_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::deque<ClientRun>> not_started_of_ ABSL_GUARDED_BY(mu_);
  uint64_t not_started_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<size_t> not_started_count_{0};
  absl::flat_hash_map<uint64_t, std::vector<uint64_t>> withdrawn_meshes_ ABSL_GUARDED_BY(mu_);  // by mesh
  std::deque<std::pair<uint64_t, uint64_t>> withdrawn_mesh_order_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> failed_order_ ABSL_GUARDED_BY(mu_);  // the keys of failed_calls_' entries, oldest first
};

}  // namespace pathways::collective
