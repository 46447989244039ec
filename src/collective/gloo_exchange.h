// Cross-host exchanges for collectives, over Gloo's TCP transport.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "collective/collective.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace pathways::collective {

// One host's Gloo endpoint. Hosts of a group find each other through a KeyValueStore (the
// controller's, across processes). One Gloo context per set of member devices, created at the
// first collective that needs it and kept: a later gang on the same devices reuses its
// connections. Calls on one context are serialised, which is safe because the devices involved
// run one gang computation at a time, in the island's order; calls are told apart by tag, so
// gangs ordered inconsistently time out instead of exchanging each other's data. Thread-safe.
class GlooExchange : public CrossHostExchange {
 public:
  // `ip` is the address this host's Gloo device listens on (other hosts connect to it).
  static absl::StatusOr<std::unique_ptr<GlooExchange>> Create(const std::string& ip,
                                                              std::shared_ptr<KeyValueStore> store);
  ~GlooExchange() override;

  absl::StatusOr<std::vector<std::string>> AllGather(const std::vector<std::string>& hosts, int mine,
                                                     const std::string& member_key, uint32_t tag,
                                                     const std::string& local, absl::Duration timeout) override;

 private:
  struct Connection;
  GlooExchange(std::shared_ptr<gloo::transport::Device> device, std::shared_ptr<KeyValueStore> store);
  absl::StatusOr<std::shared_ptr<Connection>> ConnectionFor(const std::vector<std::string>& hosts, int mine,
                                                            const std::string& member_key, absl::Duration timeout);
  absl::Status AllGatherOn(Connection& connection, const std::vector<std::string>& hosts, uint32_t tag,
                           const std::string& local, absl::Duration timeout, std::vector<std::string>& result);
  // Drops a failed connection (Gloo closes its pairs on a timeout). Each host counts the
  // connections it dropped per device set and names the next one's rendezvous by that count:
  // hosts that failed together reconnect together.
  void Discard(const std::string& member_key, const std::shared_ptr<Connection>& connection);

  std::shared_ptr<gloo::transport::Device> device_;
  const std::shared_ptr<KeyValueStore> store_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> generations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways::collective
