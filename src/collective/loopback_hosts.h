// Test support for the collective links: H hosts as threads in one process, each with its own
// TcpLinks over real loopback connections, sharing an in-memory rendezvous store.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "collective/cross_host.h"
#include "collective/tcp_links.h"
#include "gtest/gtest.h"

namespace pathways::collective {

class Hosts {
 public:
  // With `dcn`, host h is in island h and every host emulates the network between islands. Host
  // h proves `secrets[h]` when it connects (none when not given).
  explicit Hosts(int n, DcnOptions dcn = {}, std::vector<std::string> secrets = {}) {
    secrets.resize(n);
    for (int h = 0; h < n; ++h) names_.push_back(absl::StrCat("host", h));
    for (int h = 0; h < n; ++h) {
      if (dcn.enabled()) {
        dcns_.push_back(std::make_unique<DcnEmulation>(h, dcn));
        for (int g = 0; g < n; ++g) dcns_.back()->NoteHost(names_[g], g);
      }
      auto links =
          TcpLinks::Create(names_[h], "127.0.0.1", store_, dcn.enabled() ? dcns_.back().get() : nullptr, secrets[h]);
      EXPECT_TRUE(links.ok()) << links.status();
      links_.push_back(*std::move(links));
    }
  }
  // Runs body(host, steps) on every host at once, on a mesh named `key`; one status per host.
  std::vector<absl::Status> Run(const std::string& key, uint64_t tag,
                                const std::function<absl::Status(int, MeshSteps&)>& body,
                                absl::Duration timeout = absl::Seconds(10)) {
    std::vector<absl::Status> results(names_.size());
    std::vector<std::thread> threads;
    for (int h = 0; h < static_cast<int>(names_.size()); ++h) {
      threads.emplace_back([&, h] {
        results[h] = links_[h]->Run(names_, h, key, {tag, 0}, absl::Now() + timeout, [&](PeerMesh& mesh) {
          MeshSteps steps(mesh, {tag, 0}, 7, absl::Now() + timeout);
          return body(h, steps);
        });
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }
  int size() const { return static_cast<int>(names_.size()); }
  TcpLinks& links(int h) { return *links_[h]; }

 private:
  std::shared_ptr<InMemoryKeyValueStore> store_ = std::make_shared<InMemoryKeyValueStore>();
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<DcnEmulation>> dcns_;
  std::vector<std::unique_ptr<TcpLinks>> links_;
};

inline void ExpectAllOk(const std::vector<absl::Status>& results) {
  for (size_t h = 0; h < results.size(); ++h) EXPECT_TRUE(results[h].ok()) << "host " << h << ": " << results[h];
}

// Two hosts sum 1 and 2 in call `tag`, on mesh "k": both get 3, so they met.
inline void ExpectTwoHostsMeet(Hosts& hosts, uint64_t tag) {
  int32_t v[2] = {1, 2};
  ExpectAllOk(hosts.Run("k", tag, [&](int h, MeshSteps& s) {
    char* p = reinterpret_cast<char*>(&v[h]);
    return AllReduceAcrossHosts(s, DType::kI32, ReduceOp::kSum, p, p, 1);
  }));
  EXPECT_EQ(v[0], 3);
  EXPECT_EQ(v[1], 3);
}

}  // namespace pathways::collective
