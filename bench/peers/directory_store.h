// A key-value store for peers that meet without a controller: keys as files in a directory shared
// by the processes (bench/peers/multicontroller_*.cc).
#pragma once

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "collective/collective.h"

namespace pathways::bench {

// Keys as files in a directory shared by the processes: written to a temporary name and renamed,
// so a reader never sees a partial value.
class DirectoryStore : public collective::KeyValueStore {
 public:
  explicit DirectoryStore(std::string dir) : dir_(std::move(dir)) {}
  absl::Status Set(const std::string& key, std::string value) override {
    const std::string path = Path(key), tmp = absl::StrCat(path, ".tmp.", getpid());
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

}  // namespace pathways::bench
