// A text file of the user's as training data: its bytes are the tokens (a vocabulary of 256), and
// sequence s of step k is the `length` bytes from an offset drawn from (seed, k, s), so any host
// draws any part of any batch, the same on every run, with no reader state. Torch-free; the compute
// layer offers it to bodies as `pathways.text_tokens`.
//
// Bodies run a tenant's code on a worker's host, so a worker reads data only from the directories
// its operator named (`pathways worker --data-dir DIR`); by default from none. Paths are resolved
// (symbolic links and `..` included) before they are checked, the file that was opened is checked
// again, and a path that is not under an allowed directory is refused the same way whether or not
// it exists (no probing of the host's files). Files are read with pread, not mapped: a file the
// operator truncates while it is in use fails a draw instead of crashing the worker.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace pathways {

class TextSource {
 public:
  static constexpr int kVocab = 256;
  // The file at `path`, open read-only; shared within the process while it stays the same file
  // (device and inode) of the same size and modification time. PermissionDenied for a path outside
  // every allowed directory, NotFound / InvalidArgument for one under them that cannot be read or
  // is empty.
  static absl::StatusOr<std::shared_ptr<const TextSource>> Open(const std::string& path);
  ~TextSource();

  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // The file as opened: its device, inode, size, modification time and path (a cache key for its
  // batches: a file changed since is opened again, under another key).
  std::string identity() const;
  // Sequences first .. first + count - 1 of batch `step` under `seed`, each `length` tokens,
  // row-major into `out`. A sequence longer than the file wraps around to its start. DataLoss if
  // the file shrank since it was opened.
  absl::Status Sample(uint64_t seed, uint64_t step, int64_t first, int64_t count, int64_t length, int64_t* out) const;

 private:
  TextSource() = default;
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  uint64_t device_ = 0, inode_ = 0;
  int64_t modified_ns_ = 0;
};

// Lets bodies in this process read data files under `directory` (which must exist). Thread-safe.
absl::Status AllowDataDirectory(const std::string& directory);

}  // namespace pathways
