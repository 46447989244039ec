#include "tools/flags.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(FlagsTest, ParsesBothFormsAndRejectsUnknown) {
  const char* argv[] = {"--island", "1", "--devices=4"};
  auto f = Flags::Parse(3, const_cast<char**>(argv), {"island", "devices"});
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f->GetInt("island", 0), 1);
  EXPECT_EQ(*f->GetInt("devices", 0), 4);
  EXPECT_EQ(*f->GetInt("absent", 9), 9);
  const char* bad[] = {"--nope", "1"};
  EXPECT_FALSE(Flags::Parse(2, const_cast<char**>(bad), {"island"}).ok());
  const char* dangling[] = {"--island"};
  EXPECT_FALSE(Flags::Parse(1, const_cast<char**>(dangling), {"island"}).ok());
}

// A file a flag names is checked at start without harm: one this made goes again, an existing
// one keeps its bytes, and one that cannot be written is named with the flag.
TEST(FlagsTest, FilesThatCannotBeWrittenAreRefusedAtStart) {
  const std::string dir = ::testing::TempDir() + "/flags_test_" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  absl::Cleanup remove_dir = [&dir] { std::filesystem::remove_all(dir); };
  const std::string fresh = dir + "/fresh.json", kept = dir + "/kept.json", missing = dir + "/no/such/dir.json";
  { std::ofstream(kept) << "keep me"; }
  std::vector<std::string> args = {"--a", fresh, "--b", kept, "--c", missing};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  auto f = Flags::Parse(static_cast<int>(argv.size()), argv.data(), {"a", "b", "c", "unset"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->CheckWritable("unset").ok());
  EXPECT_TRUE(f->CheckWritable("a").ok());
  EXPECT_FALSE(std::filesystem::exists(fresh));
  EXPECT_TRUE(f->CheckWritable("b").ok());
  std::string content;
  std::getline(std::ifstream(kept), content);
  EXPECT_EQ(content, "keep me");
  absl::Status bad = f->CheckWritable("c");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("--c: cannot write " + missing), std::string::npos) << bad;
}

TEST(FlagsTest, SwitchesTakeNoValue) {
  const char* argv[] = {"--print-ir", "--hosts", "2"};
  auto f = Flags::Parse(3, const_cast<char**>(argv), {"hosts"}, {"print-ir"});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->Has("print-ir"));
  EXPECT_EQ(*f->GetInt("hosts", 0), 2);
}

// A last flag with no value is named as unknown when it is (`--help`, a misspelling), and as short
// of a value only when it is known.
TEST(FlagsTest, AnUnknownLastFlagIsUnknownRatherThanShortOfAValue) {
  const char* help[] = {"--hosts", "2", "--help"};
  auto f = Flags::Parse(3, const_cast<char**>(help), {"hosts"});
  EXPECT_NE(f.status().message().find("unknown flag --help; known: --hosts"), std::string::npos) << f.status();
  const char* short_of[] = {"--hosts"};
  f = Flags::Parse(1, const_cast<char**>(short_of), {"hosts"});
  EXPECT_NE(f.status().message().find("flag --hosts needs a value"), std::string::npos) << f.status();
}

TEST(FlagsTest, AddressesAreRangeChecked) {
  const char* argv[] = {"--listen", "127.0.0.1:70000", "--a", "[::1]:80", "--b", "::1:80", "--c", "h:0", "--d", "h:x"};
  auto f = Flags::Parse(10, const_cast<char**>(argv), {"listen", "a", "b", "c", "d"});
  ASSERT_TRUE(f.ok());
  auto wrapped = f->GetAddress("listen", "", true);
  EXPECT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("70000"), std::string::npos);
  EXPECT_EQ(*f->GetAddress("a", "", false), "[::1]:80");
  EXPECT_FALSE(f->GetAddress("b", "", false).ok());  // IPv6 without brackets
  EXPECT_TRUE(f->GetAddress("c", "", true).ok());    // port 0 for a server
  EXPECT_FALSE(f->GetAddress("c", "", false).ok());  // not for a peer
  EXPECT_FALSE(f->GetAddress("d", "", true).ok());
  EXPECT_EQ(*f->GetAddress("absent", "127.0.0.1:7000", false), "127.0.0.1:7000");
}

TEST(FlagsTest, ParsesSizes) {
  EXPECT_EQ(*ParseBytes("1GiB"), int64_t{1} << 30);
  EXPECT_EQ(*ParseBytes("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("4096"), 4096);
  EXPECT_FALSE(ParseBytes("lots").ok());
  EXPECT_FALSE(ParseBytes("-1GiB").ok());
  EXPECT_FALSE(ParseBytes("99999999999GiB").ok());
}

}  // namespace
}  // namespace pathways
