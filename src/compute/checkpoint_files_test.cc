#include "compute/checkpoint_files.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

const std::string kSecret = "0123456789abcdef0123456789abcdef";

std::string TempDir() {
  char pattern[] = "/tmp/checkpoint_files_test.XXXXXX";
  return mkdtemp(pattern);
}

TEST(CheckpointFilesTest, AShardReadsBackAsWritten) {
  EXPECT_EQ(WriteCheckpointShard({kSecret, 1, "w", 0}, DType::kF32, {2}, "12345678", 8).code(),
            absl::StatusCode::kFailedPrecondition);  // no directory yet
  ASSERT_TRUE(SetCheckpointDirectory(TempDir()).ok());
  std::vector<float> data = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(WriteCheckpointShard({kSecret, 3, "w_m", 1}, DType::kF32, {2, 3}, data.data(), 24).ok());
  std::vector<float> back(6);
  ASSERT_TRUE(ReadCheckpointShard({kSecret, 3, "w_m", 1}, DType::kF32, {2, 3}, back.data(), 24).ok());
  EXPECT_EQ(back, data);
  // Another shard, step, name or secret is another file; another shape is refused.
  EXPECT_EQ(ReadCheckpointShard({kSecret, 3, "w_m", 0}, DType::kF32, {2, 3}, back.data(), 24).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadCheckpointShard({kSecret, 4, "w_m", 1}, DType::kF32, {2, 3}, back.data(), 24).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadCheckpointShard({"f" + kSecret.substr(1), 3, "w_m", 1}, DType::kF32, {2, 3}, back.data(), 24).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadCheckpointShard({kSecret, 3, "w_m", 1}, DType::kF32, {3, 2}, back.data(), 24).code(),
            absl::StatusCode::kInvalidArgument);
  // Names cannot leave the checkpoint's directory, and secrets are long.
  EXPECT_EQ(WriteCheckpointShard({kSecret, 3, "../x", 0}, DType::kF32, {1}, data.data(), 4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteCheckpointShard({"abc", 3, "x", 0}, DType::kF32, {1}, data.data(), 4).code(),
            absl::StatusCode::kInvalidArgument);
}

// A file cut short, grown, or with a flipped byte is refused as DataLoss, never loaded.
TEST(CheckpointFilesTest, DamagedShardsAreRefused) {
  const std::string dir = TempDir();
  ASSERT_TRUE(SetCheckpointDirectory(dir).ok());
  std::vector<float> data(64, 1.5f), back(64);
  ASSERT_TRUE(WriteCheckpointShard({kSecret, 0, "p", 0}, DType::kF32, {64}, data.data(), 256).ok());
  std::string path;  // the one file: dir/<hash of the secret>/step-0/p.0
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.path().filename() == "p.0") path = entry.path();
  }
  ASSERT_FALSE(path.empty());
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto read_with = [&](const std::string& content) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    return ReadCheckpointShard({kSecret, 0, "p", 0}, DType::kF32, {64}, back.data(), 256).code();
  };
  EXPECT_EQ(read_with(bytes), absl::StatusCode::kOk);
  EXPECT_EQ(read_with(bytes.substr(0, bytes.size() - 10)), absl::StatusCode::kDataLoss);
  EXPECT_EQ(read_with(bytes + "x"), absl::StatusCode::kDataLoss);
  std::string flipped = bytes;
  flipped[flipped.size() - 7] ^= 1;
  EXPECT_EQ(read_with(flipped), absl::StatusCode::kDataLoss);
  EXPECT_EQ(read_with("garbage"), absl::StatusCode::kDataLoss);
}

// A valid file in the place of another (found by a hostile try: another run's shard of the same
// name, the same array at another step, another array of the same shape, another shard) is
// refused, not loaded.
TEST(CheckpointFilesTest, AValidShardCopiedInPlaceOfAnotherIsRefused) {
  const CheckpointShard target{kSecret, 40, "wq", 0};
  const std::string other_secret(32, 'e');
  std::vector<float> data(16, 2.5f), back(16);
  for (const CheckpointShard& other :
       {CheckpointShard{other_secret, 40, "wq", 0}, CheckpointShard{kSecret, 10, "wq", 0},
        CheckpointShard{kSecret, 40, "wk", 0}, CheckpointShard{kSecret, 40, "wq", 1}}) {
    const std::string dir = TempDir();
    ASSERT_TRUE(SetCheckpointDirectory(dir).ok());
    ASSERT_TRUE(WriteCheckpointShard(other, DType::kF32, {16}, data.data(), 64).ok());
    std::string other_path;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      if (entry.is_regular_file()) other_path = entry.path();
    }
    ASSERT_TRUE(WriteCheckpointShard(target, DType::kF32, {16}, data.data(), 64).ok());
    std::string target_path;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
      if (entry.is_regular_file() && entry.path() != other_path) target_path = entry.path();
    }
    ASSERT_FALSE(other_path.empty() || target_path.empty());
    ASSERT_TRUE(ReadCheckpointShard(target, DType::kF32, {16}, back.data(), 64).ok());
    std::filesystem::copy_file(other_path, target_path, std::filesystem::copy_options::overwrite_existing);
    const absl::Status read = ReadCheckpointShard(target, DType::kF32, {16}, back.data(), 64);
    EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << other.name << " " << other.step << " " << other.shard;
    EXPECT_NE(read.message().find("is not shard 0 of wq at step 40 of this checkpoint"), std::string::npos) << read;
  }
  // A shard of the format before (no identity) is named as such, not as damage.
  const std::string dir = TempDir();
  ASSERT_TRUE(SetCheckpointDirectory(dir).ok());
  ASSERT_TRUE(WriteCheckpointShard(target, DType::kF32, {16}, data.data(), 64).ok());
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::fstream file(entry.path(), std::ios::binary | std::ios::in | std::ios::out);
    file.seekp(7);
    file.put('1');  // PWSHARD1
  }
  const absl::Status old = ReadCheckpointShard(target, DType::kF32, {16}, back.data(), 64);
  EXPECT_EQ(old.code(), absl::StatusCode::kFailedPrecondition) << old;
  EXPECT_NE(old.message().find("shard format 1 by another version"), std::string::npos) << old;
}

}  // namespace
}  // namespace pathways
