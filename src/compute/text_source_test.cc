#include "compute/text_source.h"

#include <stdlib.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace pathways {
namespace {

std::string TempDir() {
  char pattern[] = "/tmp/text_source_test.XXXXXX";
  return mkdtemp(pattern);
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Nothing is readable until a directory is allowed, and then only what lies under it, whatever
// the path says (.., symbolic links out of it).
TEST(TextSourceTest, OnlyFilesUnderAllowedDirectoriesAreRead) {
  const std::string allowed = TempDir(), other = TempDir();
  Write(allowed + "/a.txt", "hello world");
  Write(other + "/secret.txt", "do not read");
  EXPECT_EQ(TextSource::Open(allowed + "/a.txt").status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(AllowDataDirectory(allowed).ok());
  EXPECT_TRUE(TextSource::Open(allowed + "/a.txt").ok());
  auto escaped = TextSource::Open(allowed + "/../" + other.substr(5) + "/secret.txt");
  EXPECT_EQ(escaped.status().code(), absl::StatusCode::kPermissionDenied) << escaped.status();
  ASSERT_EQ(symlink((other + "/secret.txt").c_str(), (allowed + "/link.txt").c_str()), 0);
  EXPECT_EQ(TextSource::Open(allowed + "/link.txt").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(TextSource::Open(allowed + "/missing.txt").status().code(), absl::StatusCode::kNotFound);
  // Outside, a missing file and an existing one are refused alike: no probing of the host.
  EXPECT_EQ(TextSource::Open(other + "/missing.txt").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(TextSource::Open("/nonexistent/x").status().code(), absl::StatusCode::kPermissionDenied);
  Write(allowed + "/empty.txt", "");
  EXPECT_EQ(TextSource::Open(allowed + "/empty.txt").status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(mkdir((allowed + "/sub").c_str(), 0700), 0);
  EXPECT_EQ(TextSource::Open(allowed + "/sub").status().code(), absl::StatusCode::kInvalidArgument);  // a directory
  EXPECT_FALSE(AllowDataDirectory(allowed + "/a.txt").ok());
}

// Sequences are runs of the file's bytes (wrapping at its end), the same whoever draws them, and
// different sequences start at different places.
TEST(TextSourceTest, SequencesAreRunsOfTheFileDrawnByCounter) {
  const std::string dir = TempDir();
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  Write(dir + "/abc.txt", text);
  ASSERT_TRUE(AllowDataDirectory(dir).ok());
  auto source = TextSource::Open(dir + "/abc.txt");
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->size(), 1000);
  constexpr int64_t kCount = 8, kLength = 40;
  std::vector<int64_t> all(kCount * kLength), part(2 * kLength);
  ASSERT_TRUE((*source)->Sample(3, 7, 0, kCount, kLength, all.data()).ok());
  ASSERT_TRUE((*source)->Sample(3, 7, 5, 2, kLength, part.data()).ok());
  EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + 5 * kLength));
  std::set<int64_t> starts;
  for (int64_t s = 0; s < kCount; ++s) {
    for (int64_t t = 1; t < kLength; ++t) {
      const int64_t prev = all[s * kLength + t - 1], cur = all[s * kLength + t];
      ASSERT_EQ(cur, 'a' + (prev - 'a' + 1) % 26) << "sequence " << s << " token " << t;
    }
    starts.insert(all[s * kLength]);
  }
  EXPECT_GT(starts.size(), 3u);
  std::vector<int64_t> next_step(kCount * kLength);
  ASSERT_TRUE((*source)->Sample(3, 8, 0, kCount, kLength, next_step.data()).ok());
  EXPECT_NE(next_step, all);
}

// A file the operator truncates while it is in use fails the draw (DataLoss) instead of crashing
// the worker; opened again, the new content is read.
TEST(TextSourceTest, AFileTruncatedInUseFailsTheDrawAndIsReadAgainWhenOpened) {
  const std::string dir = TempDir();
  Write(dir + "/long.txt", std::string(4096, 'x'));
  ASSERT_TRUE(AllowDataDirectory(dir).ok());
  auto source = TextSource::Open(dir + "/long.txt");
  ASSERT_TRUE(source.ok()) << source.status();
  ASSERT_EQ(truncate((dir + "/long.txt").c_str(), 10), 0);
  std::vector<int64_t> out(64 * 100);
  EXPECT_EQ((*source)->Sample(1, 1, 0, 64, 100, out.data()).code(), absl::StatusCode::kDataLoss);
  auto again = TextSource::Open(dir + "/long.txt");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->size(), 10);
  EXPECT_TRUE((*again)->Sample(1, 1, 0, 64, 100, out.data()).ok());
}

// A file rewritten in place with as many bytes (same inode, same size) is a changed file: opened
// again, under another identity (batches drawn ahead are keyed by it), and read as it is now.
TEST(TextSourceTest, AFileRewrittenInPlaceWithItsSizeIsOpenedAgain) {
  const std::string dir = TempDir();
  const std::string path = dir + "/same_size.txt";
  Write(path, std::string(64, 'a'));
  ASSERT_TRUE(AllowDataDirectory(dir).ok());
  auto before = TextSource::Open(path);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(TextSource::Open(path)->get(), before->get());  // unchanged: shared
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  const ino_t inode = st.st_ino;
  Write(path, std::string(64, 'b'));  // truncated and written again: the same inode
  struct timespec times[2] = {{0, UTIME_OMIT}, {st.st_mtim.tv_sec + 1, st.st_mtim.tv_nsec}};
  // Its time moved on a second, in case the file system cannot tell the two writes apart.
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  ASSERT_EQ(st.st_ino, inode);
  auto after = TextSource::Open(path);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_NE((*after)->identity(), (*before)->identity());
  std::vector<int64_t> out(8);
  ASSERT_TRUE((*after)->Sample(1, 0, 0, 1, 8, out.data()).ok());
  EXPECT_EQ(out[0], 'b');
}

}  // namespace
}  // namespace pathways
