#include "compute/text_source.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

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

absl::StatusOr<std::shared_ptr<const TextSource>> TextSource::Open(const std::string& path) {
  auto resolved = Resolve(path);
  if (!resolved.ok()) return resolved.status();
  std::lock_guard<std::mutex> lock(mu);
  bool allowed = false;
  for (const std::string& dir : AllowedDirectories()) allowed = allowed || absl::StartsWith(*resolved, dir + "/");
  if (!allowed) {
    return absl::PermissionDeniedError(absl::StrCat(
        "data file ", path, " is outside the directories this worker reads data from (pathways worker --data-dir)"));
  }
  static auto* open = new std::map<std::string, std::shared_ptr<const TextSource>>();
  auto& source = (*open)[*resolved];
  if (source != nullptr) return source;
  const int fd = ::open(resolved->c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("data file ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) {
    ::close(fd);
    open->erase(*resolved);
    return absl::InvalidArgumentError(absl::StrCat("data file ", path, " is not a non-empty regular file"));
  }
  void* data = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (data == MAP_FAILED) {
    open->erase(*resolved);
    return absl::InternalError(absl::StrCat("data file ", path, ": mmap: ", std::strerror(errno)));
  }
  std::shared_ptr<TextSource> made(new TextSource());
  made->path_ = *resolved;
  made->data_ = static_cast<const unsigned char*>(data);
  made->size_ = st.st_size;
  source = made;
  return source;
}

TextSource::~TextSource() {
  if (data_ != nullptr) munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_));
}

void TextSource::Sample(uint64_t seed, uint64_t step, int64_t first, int64_t count, int64_t length,
                        int64_t* out) const {
  const uint64_t span = static_cast<uint64_t>(size_);
  for (int64_t s = 0; s < count; ++s) {
    const uint64_t sequence = static_cast<uint64_t>(first + s);
    const auto words = PhiloxBlock({static_cast<uint32_t>(sequence), static_cast<uint32_t>(sequence >> 32),
                                    static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32)},
                                   {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
    uint64_t at = ((uint64_t{words[0]} << 32) | words[1]) % span;
    for (int64_t t = 0; t < length; ++t) {
      out[s * length + t] = data_[at];
      if (++at == span) at = 0;
    }
  }
}

}  // namespace pathways
