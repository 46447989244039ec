#include "compute/checkpoint_files.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/sha.h"

namespace pathways {
namespace {

// Version 2 carries the shard's identity (Identity below); version 1 files are refused.
constexpr char kMagic[8] = {'P', 'W', 'S', 'H', 'A', 'R', 'D', '2'};
constexpr int kMaxRank = 16;

std::mutex mu;
std::string& Root() {
  static auto* root = new std::string();
  return *root;
}

// FNV-1a over 64-bit words, then the tail: catches torn and altered files, not forgeries (the
// directory is the operator's; the secret is what keeps tenants apart).
uint64_t Checksum(const unsigned char* data, int64_t bytes) {
  uint64_t h = 14695981039346656037ull;
  int64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < bytes; ++i) h = (h ^ data[i]) * 1099511628211ull;
  return h;
}

// Which shard a file is: SHA-256 of the checkpoint's secret, the step, the array's name and the
// shard index, each length-prefixed. A file holds it in its header, so one copied or moved in
// place of another (another run's, another step's, another array's or shard's, all valid files)
// is refused when read instead of loaded as this shard.
using ShardIdentity = std::array<unsigned char, SHA256_DIGEST_LENGTH>;
ShardIdentity Identity(const CheckpointShard& which) {
  const std::string encoded = absl::StrCat(which.secret.size(), ":", which.secret, ":", which.step, ":",
                                           which.name.size(), ":", which.name, ":", which.shard);
  ShardIdentity identity;
  SHA256(reinterpret_cast<const unsigned char*>(encoded.data()), encoded.size(), identity.data());
  return identity;
}

absl::Status ErrnoStatus(int error, const std::string& what) {
  const absl::StatusCode code = error == ENOENT                   ? absl::StatusCode::kNotFound
                                : error == ENOSPC || error == EDQUOT ? absl::StatusCode::kResourceExhausted
                                : error == EACCES || error == EPERM ? absl::StatusCode::kPermissionDenied
                                                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", std::strerror(error)));
}
absl::Status Errno(const std::string& what) { return ErrnoStatus(errno, what); }

// DIR/<sha256(secret)>/step-<N>, after checking what the names may hold.
absl::StatusOr<std::string> StepDirectory(const CheckpointShard& which) {
  if (which.secret.size() < 32 || which.secret.size() > 128 ||
      !std::all_of(which.secret.begin(), which.secret.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::InvalidArgumentError("a checkpoint's secret is 32 to 128 hex digits");
  }
  if (which.name.empty() || which.name.size() > 128 ||
      !std::all_of(which.name.begin(), which.name.end(),
                   [](char c) { return absl::ascii_isalnum(c) || c == '_' || c == '-'; })) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint array name '", which.name,
                                                   "' is not 1 to 128 letters, digits, '_' or '-'"));
  }
  if (which.step < 0 || which.shard < 0) return absl::InvalidArgumentError("negative checkpoint step or shard");
  std::string root;
  {
    std::lock_guard<std::mutex> lock(mu);
    root = Root();
  }
  if (root.empty()) {
    return absl::FailedPreconditionError(
        "this worker keeps no checkpoints (start it with --checkpoint-dir DIR)");
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(which.secret.data()), which.secret.size(), digest);
  const std::string hash =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
  return absl::StrCat(root, "/", hash, "/step-", which.step);
}

absl::Status MakeDirectories(const std::string& path) {
  for (size_t at = path.find('/', 1);; at = path.find('/', at + 1)) {
    const std::string prefix = path.substr(0, at);  // the whole path last
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) return Errno(absl::StrCat("checkpoint directory ", prefix));
    if (at == std::string::npos) return absl::OkStatus();
  }
}

// 0, or the errno of the write that failed (EIO for one that wrote nothing).
int WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return 0;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

absl::Status SetCheckpointDirectory(const std::string& directory) {
  char resolved[PATH_MAX];
  struct stat st;
  if (realpath(directory.c_str(), resolved) == nullptr || stat(resolved, &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint directory ", directory, " is not a directory"));
  }
  std::lock_guard<std::mutex> lock(mu);
  Root() = resolved;
  return absl::OkStatus();
}

absl::Status WriteCheckpointShard(const CheckpointShard& which, DType dtype, const Shape& shape, const void* data,
                                  int64_t bytes) {
  auto dir = StepDirectory(which);
  if (!dir.ok()) return dir.status();
  if (shape.size() > kMaxRank) return absl::InvalidArgumentError("a checkpoint shard has at most 16 dimensions");
  if (absl::Status made = MakeDirectories(*dir); !made.ok()) return made;
  const std::string path = absl::StrCat(*dir, "/", which.name, ".", which.shard);
  const std::string temporary = absl::StrCat(path, ".tmp");
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Errno(absl::StrCat("checkpoint shard ", path));
  const int32_t header[2] = {static_cast<int32_t>(dtype), static_cast<int32_t>(shape.size())};
  const uint64_t checksum = Checksum(static_cast<const unsigned char*>(data), bytes);
  const ShardIdentity identity = Identity(which);
  int error = 0;
  for (const auto& [part, size] : std::initializer_list<std::pair<const void*, size_t>>{
           {kMagic, sizeof(kMagic)},
           {identity.data(), identity.size()},
           {header, sizeof(header)},
           {shape.data(), shape.size() * sizeof(int64_t)},
           {&bytes, sizeof(bytes)},
           {&checksum, sizeof(checksum)},
           {data, static_cast<size_t>(bytes)}}) {
    if (error == 0) error = WriteAll(fd, part, size);
  }
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && ::rename(temporary.c_str(), path.c_str()) != 0) error = errno;
  if (error != 0) {
    ::unlink(temporary.c_str());
    return ErrnoStatus(error, absl::StrCat("writing checkpoint shard ", path));
  }
  return absl::OkStatus();
}

absl::Status ReadCheckpointShard(const CheckpointShard& which, DType dtype, const Shape& shape, void* out,
                                 int64_t bytes) {
  auto dir = StepDirectory(which);
  if (!dir.ok()) return dir.status();
  const std::string path = absl::StrCat(*dir, "/", which.name, ".", which.shard);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return errno == ENOENT
               ? absl::NotFoundError(absl::StrCat("checkpoint ", which.name, " shard ", which.shard, " of step ",
                                                  which.step, " is not on this host"))
               : Errno(absl::StrCat("checkpoint shard ", path));
  }
  char magic[sizeof(kMagic)];
  ShardIdentity identity;
  int32_t header[2];
  int64_t dims[kMaxRank];
  int64_t stored_bytes = 0;
  uint64_t checksum = 0;
  absl::Status status;
  auto corrupt = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat("checkpoint shard ", path, " ", what));
  };
  const bool has_magic = ReadAll(fd, magic, sizeof(magic));
  if (has_magic && std::memcmp(magic, kMagic, sizeof(kMagic) - 1) == 0 && magic[sizeof(kMagic) - 1] != kMagic[7]) {
    status = absl::FailedPreconditionError(
        absl::StrCat("checkpoint shard ", path, " was written in shard format ", std::string(1, magic[7]),
                     " by another version; this version reads format ", std::string(1, kMagic[7]),
                     " only: start afresh, or resume from a checkpoint this version saved"));
  } else if (!has_magic || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0 ||
             !ReadAll(fd, identity.data(), identity.size()) || !ReadAll(fd, header, sizeof(header)) ||
             header[1] < 0 || header[1] > kMaxRank ||
             !ReadAll(fd, dims, static_cast<size_t>(header[1]) * sizeof(int64_t)) ||
             !ReadAll(fd, &stored_bytes, sizeof(stored_bytes)) || !ReadAll(fd, &checksum, sizeof(checksum))) {
    status = corrupt("has no valid header");
  } else if (identity != Identity(which)) {
    status = corrupt(absl::StrCat("is not shard ", which.shard, " of ", which.name, " at step ", which.step,
                                  " of this checkpoint (a file copied or moved from another checkpoint, step, "
                                  "array or shard, or its header is damaged)"));
  } else if (header[0] != static_cast<int32_t>(dtype) || Shape(dims, dims + header[1]) != shape) {
    status = absl::InvalidArgumentError(absl::StrCat("checkpoint shard ", path, " holds ",
                                                     DTypeName(static_cast<DType>(header[0])),
                                                     ShapeToString(Shape(dims, dims + header[1])), ", not ",
                                                     DTypeName(dtype), ShapeToString(shape)));
  } else if (stored_bytes != bytes || !ReadAll(fd, out, static_cast<size_t>(bytes))) {
    status = corrupt("is shorter than its header says");
  } else if (char extra; ::read(fd, &extra, 1) != 0) {
    status = corrupt("is longer than its header says");
  } else if (Checksum(static_cast<const unsigned char*>(out), bytes) != checksum) {
    status = corrupt("does not match its checksum");
  }
  ::close(fd);
  return status;
}

}  // namespace pathways
