// Persistent TCP connections between hosts: one host's listener, its collective meshes
// (peer_mesh.h) and point-to-point streams (block_streams.h), connected through the rendezvous
// store and reconnected after failures.
#pragma once

#include <atomic>
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

// One host's endpoint for collectives across hosts: a listening socket whose address is published
// in the rendezvous store, and one PeerMesh per set of member devices, kept across calls (a later
// gang on the same devices reuses its connections). Within a pair of hosts the one later in the
// group's host order dials. A mesh that failed is closed; its peers see the close before their
// next use and reconnect, so hosts that failed together meet again. Thread-safe.
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
  // by `key`, and runs `body` on it, holding it for the call. On any failure the mesh's
  // connections are closed. Errors of the connection itself name the hosts.
  absl::Status Run(const std::vector<std::string>& hosts, int rank, const std::string& key, absl::Time deadline,
                   absl::FunctionRef<absl::Status(PeerMesh&)> body);

  // Point-to-point streams beside the meshes: a connection dialed in with hello `key` goes to
  // `handler`, which takes the descriptor (on the listener's thread: it must not block). A null
  // handler stops taking them, once any call in progress has returned.
  void AcceptStreams(const std::string& key, std::function<void(int fd, const std::string& peer)> handler);
  // Dials `peer` for a stream named `key` (publishing this host first); the caller owns the
  // descriptor (non-blocking, TCP_NODELAY).
  absl::StatusOr<int> DialStream(const std::string& peer, const std::string& key, absl::Time deadline);

  // The host is going: meshes waiting for peers to connect (or dialing them) stop waiting, now
  // and from now on (Cancelled). Exchanges on connected meshes end by their own deadlines.
  void StopWaiting();

  // Publishes this host's address in the rendezvous store (again: a restarted store forgot it).
  // Meshes and streams publish on first use; a host that only receives calls this once it can
  // reach the store.
  absl::Status Publish();

  const std::string& address() const { return address_; }

 private:
  TcpLinks(std::string host, int listen_fd, int wake_fd, std::string address, std::shared_ptr<KeyValueStore> store,
           DcnEmulation* dcn, std::string secret);
  absl::Status Connect(PeerMesh& mesh, const std::string& key, absl::Time deadline);
  absl::StatusOr<int> Dial(const std::string& peer, const std::string& key, absl::Time deadline);
  absl::StatusOr<int> AwaitDialIn(const std::string& peer, const std::string& key, absl::Time deadline);
  // Takes a newer connection dialed in from `peer` for `key`, if one arrived; -1 otherwise.
  int TakeDialIn(const std::string& peer, const std::string& key);
  absl::Status EnsurePublished();
  // Accepts connections and reads their hellos side by side (see PendingHello in the .cc).
  void AcceptLoop();
  // Checks a complete hello (`received`, after the listener's `challenges`) and answers with this
  // host's proof; fills the hello's key and host.
  absl::Status FinishHello(int fd, absl::Time deadline, std::string challenges, const std::string& received,
                           std::string& key, std::string& peer);
  // A proven connection: to its stream handler, or to the meshes' dialed-in connections.
  void TakeConnection(int fd, std::string key, std::string peer);

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
  absl::flat_hash_map<std::string, std::shared_ptr<PeerMesh>> meshes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> addresses_ ABSL_GUARDED_BY(mu_);  // peer host -> ip:port
  // Connections dialed in, by (key, peer host), not yet taken by a mesh; a newer one replaces
  // (and closes) an older one.
  absl::flat_hash_map<std::pair<std::string, std::string>, int> dialed_in_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::collective
