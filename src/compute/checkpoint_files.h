// Checkpoint shards on a worker's disk: each device writes the shards it holds and reads them
// back, so a checkpoint never gathers on the client. Torch-free; the compute layer offers it to
// bodies as `pathways.save_shard` and `pathways.load_shard`.
//
// Where: under the directory the worker's operator named (`pathways worker --checkpoint-dir DIR`;
// none by default, and then saving fails). Which: a checkpoint is named by a secret its client
// made (at least 32 hex digits) and kept in its own manifest; shards live in
// DIR/<SHA-256 of the secret>/step-<N>/<name>.<shard>, so a tenant that does not hold the secret
// cannot name another's checkpoint (nothing lists the directory). Each file is written to a
// temporary name and renamed once complete, and carries which shard it is (a hash of the secret,
// step, array name and shard index), its dtype, shape, size and a checksum, so a torn or altered
// file, or a valid one copied in place of another, is refused when read instead of loaded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/types.h"

namespace pathways {

// Sets the directory (which must exist) checkpoints of this process go under. Thread-safe.
absl::Status SetCheckpointDirectory(const std::string& directory);

struct CheckpointShard {
  std::string secret;  // the checkpoint's
  int64_t step = 0;
  std::string name;  // the array's, within the checkpoint: letters, digits, '_' and '-'
  int64_t shard = 0;
};

absl::Status WriteCheckpointShard(const CheckpointShard& which, DType dtype, const Shape& shape, const void* data,
                                  int64_t bytes);
// Reads the shard into `out`, which must hold exactly `shape` of `dtype`. NotFound for a shard
// never written, DataLoss for one whose header, size or checksum is wrong, InvalidArgument for one
// of another shape or dtype.
absl::Status ReadCheckpointShard(const CheckpointShard& which, DType dtype, const Shape& shape, void* out,
                                 int64_t bytes);

}  // namespace pathways
