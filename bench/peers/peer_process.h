// What the peer processes that meet without a controller share (bench/peers/multicontroller_*.cc):
// a key-value store in a directory, the collective hub it connects, and their gang's layout.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collective/collective.h"
#include "collective/tcp_links.h"
#include "core/status_macros.h"

namespace pathways::bench {

// Keys as files in a directory shared by the processes: written to a temporary name and renamed,
// so a reader never sees a partial value.
class DirectoryStore : public collective::KeyValueStore {
 public:
  explicit DirectoryStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, std::string value) override {
    // A temporary name of this call's own: threads of one process may set the same key at once.
    static std::atomic<int64_t> calls{0};
    const std::string path = Path(key), tmp = absl::StrCat(path, ".tmp.", getpid(), ".", calls++);
    {
      std::ofstream out(tmp, std::ios::binary);
      out << value;
      if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return absl::UnavailableError(absl::StrCat("cannot rename ", tmp));
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      std::ifstream in(Path(key), std::ios::binary);
      if (in) {
        std::stringstream s;
        s << in.rdbuf();
        return s.str();
      }
      if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat("no key ", key));
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

 private:
  std::string Path(const std::string& key) const {
    std::string name;
    for (char c : key) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    return absl::StrCat(dir_, "/", name, "_", std::hash<std::string>()(key));
  }
  const std::string dir_;
};

// Rank `rank`'s hub, linked to the other ranks' through the store in `store_dir`.
inline absl::StatusOr<std::unique_ptr<collective::CollectiveHub>> ConnectPeerHub(int rank,
                                                                                 const std::string& store_dir) {
  const std::string host = absl::StrCat("process", rank);
  PW_ASSIGN_OR_RETURN(auto links,
                      collective::TcpLinks::Create(host, "127.0.0.1", std::make_shared<DirectoryStore>(store_dir)));
  return std::make_unique<collective::CollectiveHub>(host, std::move(links), absl::Seconds(120));
}

// The gang of `ranks` processes of `devices` devices each over a mesh of `dims` named `axes`:
// member r x devices + d is rank r's device d (row-major over the mesh).
inline std::shared_ptr<const collective::GangLayout> RankMajorLayout(std::vector<int64_t> dims,
                                                                     std::vector<std::string> axes, int ranks,
                                                                     int devices) {
  collective::GangLayout layout{std::move(dims), std::move(axes), {}};
  for (int r = 0; r < ranks; ++r) {
    for (int d = 0; d < devices; ++d) layout.members.push_back({absl::StrCat("process", r), DeviceId(r * devices + d)});
  }
  return std::make_shared<const collective::GangLayout>(std::move(layout));
}

}  // namespace pathways::bench
