// Persistent TCP connections for collectives across hosts: one host's listener and its meshes
// (peer_mesh.h), connected through the rendezvous store and reconnected after failures.
#pragma once

#include <atomic>
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
  // Listens on `ip` (port chosen by the kernel). `host` is this host's name in Member::host.
  // `dcn` (not owned, may be null) emulates the network between islands.
  static absl::StatusOr<std::unique_ptr<TcpLinks>> Create(std::string host, const std::string& ip,
                                                          std::shared_ptr<KeyValueStore> store,
                                                          DcnEmulation* dcn = nullptr);
  ~TcpLinks();

  // Connects (or reuses) the mesh among `hosts` (this host is hosts[rank]) for the devices named
  // by `key`, and runs `body` on it, holding it for the call. On any failure the mesh's
  // connections are closed. Errors of the connection itself name the hosts.
  absl::Status Run(const std::vector<std::string>& hosts, int rank, const std::string& key, absl::Time deadline,
                   absl::FunctionRef<absl::Status(PeerMesh&)> body);

  const std::string& address() const { return address_; }

 private:
  TcpLinks(std::string host, int listen_fd, int wake_fd, std::string address, std::shared_ptr<KeyValueStore> store,
           DcnEmulation* dcn);
  absl::Status Connect(PeerMesh& mesh, const std::string& key, absl::Time deadline);
  absl::StatusOr<int> Dial(const std::string& peer, const std::string& key, absl::Time deadline);
  absl::StatusOr<int> AwaitDialIn(const std::string& peer, const std::string& key, absl::Time deadline);
  // Takes a newer connection dialed in from `peer` for `key`, if one arrived; -1 otherwise.
  int TakeDialIn(const std::string& peer, const std::string& key);
  absl::Status Publish();
  void AcceptLoop();

  const std::string host_;
  const int listen_fd_;
  const int wake_fd_;
  const std::string address_;
  const std::shared_ptr<KeyValueStore> store_;
  DcnEmulation* const dcn_;
  std::thread acceptor_;
  std::atomic<bool> published_{false};
  // Counts connections dialed in: a mesh looks for newer connections only when it moved.
  std::atomic<uint64_t> dial_ins_{0};

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::shared_ptr<PeerMesh>> meshes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> addresses_ ABSL_GUARDED_BY(mu_);  // peer host -> ip:port
  // Connections dialed in, by (key, peer host), not yet taken by a mesh; a newer one replaces
  // (and closes) an older one.
  absl::flat_hash_map<std::pair<std::string, std::string>, int> dialed_in_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::collective
