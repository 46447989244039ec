#include "compute/text_source.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "compute/counter_rng.h"

namespace pathways {
namespace {

std::mutex mu;
std::set<std::string>& AllowedDirectories() {
  static auto* dirs = new std::set<std::string>();
  return *dirs;
}

absl::StatusOr<std::string> Resolve(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    return absl::NotFoundError(absl::StrCat("data file ", path, ": ", std::strerror(errno)));
  }
  return std::string(resolved);
}

}  // namespace

absl::Status AllowDataDirectory(const std::string& directory) {
  auto resolved = Resolve(directory);
  if (!resolved.ok()) return resolved.status();
  struct stat st;
  if (stat(resolved->c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("data directory ", directory, " is not a directory"));
  }
  std::lock_guard<std::mutex> lock(mu);
  AllowedDirectories().insert(*resolved == "/" ? "" : *resolved);
  return absl::OkStatus();
}

namespace {

int64_t ModifiedNs(const struct stat& st) { return int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec; }

}  // namespace

absl::StatusOr<std::shared_ptr<const TextSource>> TextSource::Open(const std::string& path) {
  auto outside = [&] {
    return absl::PermissionDeniedError(absl::StrCat(
        "data file ", path, " is outside the directories this worker reads data from (pathways worker --data-dir)"));
  };
  std::lock_guard<std::mutex> lock(mu);
  auto allowed = [](const std::string& resolved) {
    for (const std::string& dir : AllowedDirectories()) {
      if (absl::StartsWith(resolved, dir + "/")) return true;
    }
    return false;
  };
  auto resolved = Resolve(path);
  if (!resolved.ok()) {
    // Whether a path outside exists is not for a tenant to learn: only paths under an allowed
    // directory are told apart.
    return allowed(path) ? resolved.status() : outside();
  }
  if (!allowed(*resolved)) return outside();
  struct stat st;
  if (stat(resolved->c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("data file ", path, ": ", std::strerror(errno)));
  static auto* open = new std::map<std::string, std::shared_ptr<const TextSource>>();
  auto& source = (*open)[*resolved];
  if (source != nullptr && source->device_ == st.st_dev && source->inode_ == st.st_ino && source->size_ == st.st_size &&
      source->modified_ns_ == ModifiedNs(st)) {
    return source;
  }
  const int fd = ::open(resolved->c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("data file ", path, ": ", std::strerror(errno)));
  std::shared_ptr<TextSource> made(new TextSource());
  made->fd_ = fd;  // closed by the destructor from here on
  // What was opened, checked again: a directory on the way swapped for a link after the path
  // was resolved is caught here.
  char opened[PATH_MAX];
  const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), opened, sizeof(opened) - 1);
  if (n <= 0 || !allowed(std::string(opened, static_cast<size_t>(n)))) return outside();
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("data file ", path, " is not a non-empty regular file"));
  }
  made->path_ = *resolved;
  made->size_ = st.st_size;
  made->device_ = st.st_dev;
  made->inode_ = st.st_ino;
  made->modified_ns_ = ModifiedNs(st);
  source = made;
  return source;
}

TextSource::~TextSource() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TextSource::identity() const {
  return absl::StrCat(device_, ":", inode_, ":", size_, ":", modified_ns_, ":", path_);
}

absl::Status TextSource::Sample(uint64_t seed, uint64_t step, int64_t first, int64_t count, int64_t length,
                                int64_t* out) const {
  const uint64_t span = static_cast<uint64_t>(size_);
  std::vector<unsigned char> bytes(static_cast<size_t>(length));
  for (int64_t s = 0; s < count; ++s) {
    const uint64_t sequence = static_cast<uint64_t>(first + s);
    const auto words = PhiloxBlock({static_cast<uint32_t>(sequence), static_cast<uint32_t>(sequence >> 32),
                                    static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32)},
                                   {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    uint64_t at = ((uint64_t{words[0]} << 32) | words[1]) % span;
    // The run of bytes from `at`, wrapping to the file's start as often as it needs.
    for (int64_t done = 0; done < length;) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(length - done), span - at));
      const ssize_t got = ::pread(fd_, bytes.data() + done, want, static_cast<off_t>(at));
      if (got != static_cast<ssize_t>(want)) {
        return absl::DataLossError(absl::StrCat("data file ", path_, " changed while in use (a read at byte ", at,
                                                " came back short)"));
      }
      done += got;
      at = (at + static_cast<uint64_t>(got)) % span;
    }
    for (int64_t t = 0; t < length; ++t) out[s * length + t] = bytes[static_cast<size_t>(t)];
  }
  return absl::OkStatus();
}

}  // namespace pathways
