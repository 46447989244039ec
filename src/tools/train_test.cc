#include "tools/train.h"

#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

// `pathways train` as the command line runs it, in this process.
absl::Status Train(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  auto flags = Flags::Parse(static_cast<int>(argv.size()), argv.data(),
                            {"model", "steps", "batch", "seq-len", "data-parallel", "pipeline-stages", "microbatches",
                             "islands", "metrics-jsonl", "device-memory", "save", "save-every", "resume", "seed",
                             "trace", "data"});
  if (!flags.ok()) return flags.status();
  return RunTrain(*flags);
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename());
  return names;
}

class TrainCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "train_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

// Each refusal comes before any step and leaves nothing behind: no metrics file, no checkpoint
// manifest, no shards directory.
TEST_F(TrainCommandTest, BadInputFailsBeforeAnyStepAndWritesNothing) {
  const std::vector<std::string> common = {"--model", "tiny", "--steps", "2", "--seq-len", "8",
                                           "--metrics-jsonl", dir_ + "/m.jsonl", "--save", dir_ + "/ck"};
  struct Case {
    std::vector<std::string> args;
    absl::StatusCode code;
    std::string says;
  };
  const Case cases[] = {
      {{"--batch", "3", "--data-parallel", "2"}, absl::StatusCode::kInvalidArgument, "does not split"},
      {{"--batch", "4", "--pipeline-stages", "8"}, absl::StatusCode::kInvalidArgument, "stage"},
      {{"--batch", "4", "--save-every", "-1"}, absl::StatusCode::kInvalidArgument, "--save-every"},
      {{"--batch", "4", "--islands", "0"}, absl::StatusCode::kInvalidArgument, "--islands"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = common;
    args.insert(args.end(), c.args.begin(), c.args.end());
    const absl::Status status = Train(args);
    EXPECT_EQ(status.code(), c.code) << absl::StrJoin(c.args, " ") << ": " << status;
    EXPECT_TRUE(absl::StrContains(status.message(), c.says)) << status;
    EXPECT_EQ(Entries(dir_), std::vector<std::string>{}) << absl::StrJoin(c.args, " ");
  }
}

// A metrics file that cannot be written is refused before anything is made; an existing one keeps
// what it holds when the run fails before its first step.
TEST_F(TrainCommandTest, MetricsThatCannotBeWrittenFailFirstAndOldMetricsStayUntilTheRunBegins) {
  absl::Status status = Train({"--model", "tiny", "--steps", "2", "--batch", "4", "--save", dir_ + "/ck",
                               "--metrics-jsonl", dir_ + "/missing/m.jsonl"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "--metrics-jsonl")) << status;
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{});

  { std::ofstream(dir_ + "/m.jsonl") << "an earlier run's line\n"; }
  status = Train({"--model", "tiny", "--steps", "2", "--batch", "3", "--data-parallel", "2", "--metrics-jsonl",
                  dir_ + "/m.jsonl"});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  std::ifstream in(dir_ + "/m.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(line, "an earlier run's line");
}

TEST_F(TrainCommandTest, AnExistingCheckpointIsNotOverwritten) {
  { std::ofstream(dir_ + "/ck") << "a manifest"; }
  const absl::Status status =
      Train({"--model", "tiny", "--steps", "2", "--batch", "4", "--save", dir_ + "/ck", "--metrics-jsonl",
             dir_ + "/m.jsonl"});
  EXPECT_EQ(status.code(), absl::StatusCode::kAlreadyExists) << status;
  EXPECT_EQ(Entries(dir_), std::vector<std::string>{"ck"});
}

// A short run writes one JSON line per step with the fields the issue names.
TEST_F(TrainCommandTest, MetricsHaveALinePerStep) {
  ASSERT_TRUE(Train({"--model", "tiny", "--steps", "3", "--batch", "4", "--seq-len", "8", "--metrics-jsonl",
                     dir_ + "/m.jsonl"})
                  .ok());
  std::ifstream in(dir_ + "/m.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    EXPECT_TRUE(absl::StrContains(line, absl::StrCat("\"step\": ", lines, ","))) << line;
    EXPECT_TRUE(absl::StrContains(line, "\"loss\": ")) << line;
    EXPECT_TRUE(absl::StrContains(line, "\"tokens_per_s\": ")) << line;
  }
  EXPECT_EQ(lines, 3);
}

// The losses a run's --metrics-jsonl recorded.
std::vector<double> LossesIn(const std::string& path) {
  std::vector<double> losses;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\": ");
    if (at != std::string::npos) losses.push_back(std::stod(line.substr(at + 8)));
  }
  return losses;
}

// --seed picks the run (the same seed, the same losses; another, others), --trace writes the
// devices' work as trace events, and --data reads a text file of the user's (bytes as tokens).
TEST_F(TrainCommandTest, SeedTraceAndATextFileFromTheCommandLine) {
  auto run = [&](const std::string& name, std::vector<std::string> more) {
    std::vector<std::string> args = {"--model", "tiny", "--steps", "3", "--batch", "4", "--seq-len", "8",
                                      "--metrics-jsonl", dir_ + "/" + name};
    args.insert(args.end(), more.begin(), more.end());
    absl::Status s = Train(args);
    EXPECT_TRUE(s.ok()) << name << ": " << s;
    return LossesIn(dir_ + "/" + name);
  };
  const std::vector<double> a = run("a.jsonl", {"--seed", "4", "--trace", dir_ + "/trace.json"});
  const std::vector<double> again = run("again.jsonl", {"--seed", "4"});
  const std::vector<double> other = run("other.jsonl", {"--seed", "5"});
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, again);
  EXPECT_NE(a, other);
  std::ifstream trace(dir_ + "/trace.json");
  const std::string events((std::istreambuf_iterator<char>(trace)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(events, "\"traceEvents\"")) << events.substr(0, 200);
  EXPECT_TRUE(absl::StrContains(events, "\"ph\": \"X\"") || absl::StrContains(events, "\"ph\":\"X\""))
      << events.substr(0, 200);

  {
    std::ofstream text(dir_ + "/text.txt");
    for (int i = 0; i < 100; ++i) text << "abcabcabd ";
  }
  const std::vector<double> text = run("text.jsonl", {"--data", dir_ + "/text.txt"});
  ASSERT_EQ(text.size(), 3u);
  EXPECT_NEAR(text[0], std::log(256.0), 0.1);  // bytes as tokens: a vocabulary of 256
}

}  // namespace
}  // namespace pathways
