// Training the Transformer on an embedded cluster: every way of laying it out over devices computes
// the same losses, a short run learns the data down to near its entropy, and bad options fail
// before a step runs.
#include "train/trainer.h"

#include <stdlib.h>
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "cluster/local_cluster.h"
#include "compute/batch_prefetcher.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

class TrainerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char dir[] = "/tmp/trainer_test.XXXXXX";
    data_dir_ = new std::string(mkdtemp(dir));
    std::filesystem::create_directory(*data_dir_ + "/checkpoints");
    cluster_ = LocalCluster::Start({.num_islands = 2, .hosts_per_island = 2, .devices_per_host = 2,
                                    .device_memory_bytes = 64 << 20, .data_directories = {*data_dir_},
                                    .checkpoint_directory = *data_dir_ + "/checkpoints"})
                   ->release();
  }
  static void TearDownTestSuite() { delete cluster_; }

  static TrainOptions Tiny() {
    TrainOptions o;
    o.model.vocab = 32, o.model.d_model = 32, o.model.heads = 2, o.model.layers = 2, o.model.mlp_hidden = 64,
    o.model.seq_len = 16, o.model.init_seed = 5;
    o.batch = 8;
    o.chain_seed = 2;
    return o;
  }

  // The losses of the first `steps` steps, each client its own (its slices go with it).
  static absl::StatusOr<std::vector<double>> Losses(const TrainOptions& options, int steps) {
    auto client = cluster_->Connect();
    if (!client.ok()) return client.status();
    auto trainer = Trainer::Create(**client, options);
    if (!trainer.ok()) return trainer.status();
    std::vector<Future<double>> futures;
    for (int i = 0; i < steps; ++i) {
      auto loss = (*trainer)->Step();
      if (!loss.ok()) return loss.status();
      futures.push_back(*loss);
    }
    std::vector<double> losses;
    for (const Future<double>& f : futures) {
      if (!f.Await().ok()) return f.Await().status();
      losses.push_back(*f.Await());
    }
    return losses;
  }

  static LocalCluster* cluster_;
  static std::string* data_dir_;  // where the workers may read data files
};
LocalCluster* TrainerTest::cluster_ = nullptr;
std::string* TrainerTest::data_dir_ = nullptr;

// The same global batch and seed give the same losses, within float rounding, on one device and
// split every way: data parallel, tensor parallel, a pipeline of two stages with four
// microbatches (its first stage keeping its residuals, or recomputing them), two stages on two
// islands with the data axis in each, all three at once (with two and four microbatches), and one
// data axis over both islands.
TEST_F(TrainerTest, EveryParallelismComputesTheSameLosses) {
  constexpr int kSteps = 3;
  auto base = Losses(Tiny(), kSteps);
  ASSERT_TRUE(base.ok()) << base.status();
  EXPECT_NEAR((*base)[0], std::log(32.0), 0.05);  // small random weights: near uniform
  EXPECT_LT((*base)[2], (*base)[0]);
  struct Case {
    const char* name;
    ParallelLayout layout;
    int64_t microbatches;
    int islands;
    bool recompute = false;
  };
  const Case cases[] = {
      {"D=2", {.data = 2}, 1, 1},
      {"T=2", {.tensor = 2}, 1, 1},
      {"S=2 M=4", {.stages = 2}, 4, 1},
      {"S=2 M=4 recomputing", {.stages = 2}, 4, 1, true},
      {"D=2 S=2 over two islands", {.data = 2, .stages = 2}, 1, 2},
      {"D=2 T=2 S=2 M=2", {.data = 2, .tensor = 2, .stages = 2}, 2, 1},
      {"D=2 T=2 S=2 M=4", {.data = 2, .tensor = 2, .stages = 2}, 4, 1},
      // One stage whose data axis spans both islands (4 devices each): gradients all_reduced
      // across the islands, the paper's two-island data parallelism.
      {"D=8 spanning two islands", {.data = 8}, 1, 2},
  };
  for (const Case& c : cases) {
    TrainOptions o = Tiny();
    o.layout = c.layout;
    o.microbatches = c.microbatches;
    o.islands = c.islands;
    o.recompute = c.recompute;
    auto got = Losses(o, kSteps);
    ASSERT_TRUE(got.ok()) << c.name << ": " << got.status();
    for (int i = 0; i < kSteps; ++i) EXPECT_NEAR((*got)[i], (*base)[i], 2e-4 * (*base)[i]) << c.name << " step " << i;
  }
}

// A few hundred steps on a small vocabulary reach within 10% of the Markov source's entropy rate,
// the best loss there is.
TEST_F(TrainerTest, AShortRunComesWithinTenPercentOfTheEntropy) {
  TrainOptions o = Tiny();
  o.model.vocab = 16;
  o.batch = 16;
  o.adam.learning_rate = 1e-2;
  o.layout.data = 2;
  auto client = cluster_->Connect();
  ASSERT_TRUE(client.ok());
  const BatchPrefetcher::Stats before = BatchPrefetcher::Global().stats();
  auto trainer = Trainer::Create(**client, o);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::vector<Future<double>> losses;
  for (int i = 0; i < 300; ++i) losses.push_back(*(*trainer)->Step());
  double last = 0;
  for (int i = 260; i < 300; ++i) last += *losses[i].Await() / 40;
  const double entropy = (*trainer)->entropy();
  // The batches were drawn ahead, on the hosts' prefetch thread, while earlier steps computed.
  const BatchPrefetcher::Stats after = BatchPrefetcher::Global().stats();
  EXPECT_GT(after.hits - before.hits, after.misses - before.misses)
      << after.hits - before.hits << " hits, " << after.misses - before.misses << " misses";
  EXPECT_LT(last, 1.1 * entropy) << "first " << *losses[0].Await() << ", last 40 steps " << last << ", entropy "
                                 << entropy;
  EXPECT_GT(last, 0.95 * entropy);
}

// A text file's bytes as the data, read on the workers' hosts: a model learns a short text repeated
// (its next byte is all but determined) far below the uniform guess of log 256; a file outside the
// directories the workers read from fails the step with PermissionDenied naming it.
TEST_F(TrainerTest, ATextFileOfTheUsersIsTheData) {
  const std::string path = *data_dir_ + "/text.txt";
  {
    std::ofstream out(path);
    for (int i = 0; i < 200; ++i) out << "the quick brown fox jumps over the lazy dog. ";
  }
  TrainOptions o = Tiny();
  o.model.vocab = 256;
  o.text_file = path;
  o.adam.learning_rate = 1e-2;
  o.layout.data = 2;
  const BatchPrefetcher::Stats before = BatchPrefetcher::Global().stats();
  auto losses = Losses(o, 150);
  ASSERT_TRUE(losses.ok()) << losses.status();
  // Drawn ahead on the hosts as the Markov batches are (one draw per shard where a run begins).
  const BatchPrefetcher::Stats after = BatchPrefetcher::Global().stats();
  EXPECT_GT(after.hits - before.hits, 10 * (after.misses - before.misses))
      << after.hits - before.hits << " hits, " << after.misses - before.misses << " misses";
  EXPECT_NEAR(losses->front(), std::log(256.0), 0.05);
  EXPECT_LT(losses->back(), 0.25 * std::log(256.0)) << "first " << losses->front();

  o.text_file = "/etc/hostname";
  auto refused = Losses(o, 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("/etc/hostname is outside the directories"), std::string::npos)
      << refused.status();
  o.model.vocab = 32;
  EXPECT_EQ(Losses(o, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// Three steps, a checkpoint, and three more steps resumed from it by another client give the losses
// of six uninterrupted steps: parameters, Adam's moments and step count (which numbers the data)
// come back from the workers' disks. Over a pipeline of two stages with data parallelism, so every
// kind of shard is saved.
TEST_F(TrainerTest, AResumedRunHasTheLossesOfAnUninterruptedOne) {
  TrainOptions o = Tiny();
  o.layout = {.data = 2, .tensor = 1, .stages = 2};
  o.microbatches = 2;
  auto uninterrupted = Losses(o, 6);
  ASSERT_TRUE(uninterrupted.ok()) << uninterrupted.status();
  const std::string manifest = *data_dir_ + "/resume.ckpt";
  {
    auto client = cluster_->Connect();
    ASSERT_TRUE(client.ok());
    auto trainer = Trainer::Create(**client, o);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*trainer)->Step().ok());
    absl::Status saved = (*trainer)->Save(manifest);
    ASSERT_TRUE(saved.ok()) << saved;
  }
  o.resume_from = manifest;
  auto resumed = Losses(o, 3);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  for (int i = 0; i < 3; ++i) EXPECT_NEAR((*resumed)[i], (*uninterrupted)[3 + i], 1e-6) << "step " << 3 + i;
}

// A checkpoint of another model or layout, a file that is no manifest, and a damaged shard fail
// when the trainer is made, before any step; a save that fails leaves the previous manifest.
TEST_F(TrainerTest, BadCheckpointsFailBeforeAStepRuns) {
  const std::string manifest = *data_dir_ + "/bad.ckpt";
  TrainOptions o = Tiny();
  o.layout.data = 2;
  auto client = cluster_->Connect();
  ASSERT_TRUE(client.ok());
  {
    auto trainer = Trainer::Create(**client, o);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    ASSERT_TRUE((*trainer)->Step().ok());
    ASSERT_TRUE((*trainer)->Save(manifest).ok());
  }
  TrainOptions other = o;
  other.resume_from = manifest;
  other.model.d_model = 64;
  auto t = Trainer::Create(**client, other);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("holds a model"), std::string::npos) << t.status();
  other = o;
  other.resume_from = manifest;
  other.layout.data = 1;
  t = Trainer::Create(**client, other);
  EXPECT_NE(t.status().message().find("holds a layout"), std::string::npos) << t.status();
  other = o;
  other.resume_from = *data_dir_ + "/text.txt";
  std::ofstream(other.resume_from) << "not a manifest";
  EXPECT_EQ(Trainer::Create(**client, other).status().code(), absl::StatusCode::kInvalidArgument);
  other.resume_from = *data_dir_ + "/missing.ckpt";
  EXPECT_EQ(Trainer::Create(**client, other).status().code(), absl::StatusCode::kNotFound);
  // What is not a manifest is refused at once, without blocking on it or reading it whole.
  const std::string fifo = *data_dir_ + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string huge = *data_dir_ + "/huge.ckpt";
  std::ofstream(huge) << "pathways-checkpoint 1\n" << std::string(1 << 20, 'x');
  for (const std::string& path : {fifo, std::string("/dev/zero"), *data_dir_, huge}) {
    other.resume_from = path;
    EXPECT_EQ(Trainer::Create(**client, other).status().code(), absl::StatusCode::kInvalidArgument) << path;
  }
  // A save replaces a manifest, and nothing else: a file of the user's, a FIFO and a directory are
  // left alone (a device too: not tried here, where a regression would replace /dev/null), before
  // any shard is written; a missing directory is NotFound.
  {
    auto trainer = Trainer::Create(**client, o);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    const std::string text = *data_dir_ + "/text.txt";
    for (const std::string& path : {text, fifo, *data_dir_}) {
      absl::Status saved = (*trainer)->Save(path);
      EXPECT_EQ(saved.code(), absl::StatusCode::kAlreadyExists) << path << ": " << saved;
    }
    std::ifstream in(text);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), "not a manifest");
    EXPECT_EQ((*trainer)->Save(*data_dir_ + "/no/such/dir/m.ckpt").code(), absl::StatusCode::kNotFound);
  }

  // Damage one shard: flip its last byte.
  std::string secret;
  {
    std::ifstream in(manifest);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("secret ", 0) == 0) secret = line.substr(7);
    }
  }
  ASSERT_FALSE(secret.empty());
  std::string shard;
  for (const auto& e : std::filesystem::recursive_directory_iterator(*data_dir_ + "/checkpoints")) {
    // This checkpoint's step-1 shard (other tests' checkpoints share the directory at other steps).
    if (e.path().filename() == "s0_wq.1" && e.path().parent_path().filename() == "step-1") shard = e.path();
  }
  ASSERT_FALSE(shard.empty());
  std::filesystem::copy_file(shard, shard + ".good");
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 1));
  }
  other = o;
  other.resume_from = manifest;
  t = Trainer::Create(**client, other);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << t.status();
  EXPECT_NE(t.status().message().find("does not match its checksum"), std::string::npos) << t.status();
  std::filesystem::rename(shard + ".good", shard);
  EXPECT_TRUE(Trainer::Create(**client, other).ok());

  // A resumed run saves under a secret of its own: two runs resumed from one checkpoint never
  // write over each other's shards.
  {
    auto resumed = Trainer::Create(**client, other);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    const std::string again = *data_dir_ + "/again.ckpt";
    ASSERT_TRUE((*resumed)->Save(again).ok());
    auto secret_of = [](const std::string& path) {
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) {
        if (line.rfind("secret ", 0) == 0) return line.substr(7);
      }
      return std::string();
    };
    EXPECT_NE(secret_of(again), secret_of(manifest));
    EXPECT_EQ(std::filesystem::status(again).permissions() & std::filesystem::perms::others_read,
              std::filesystem::perms::none);
  }

  // A save whose directories cannot be made (a file stands where the workers' checkpoint
  // directory was) fails and leaves the manifest of the last good save.
  {
    auto trainer = Trainer::Create(**client, other);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    ASSERT_TRUE((*trainer)->Step().ok());
    const std::string root = *data_dir_ + "/checkpoints";
    std::filesystem::rename(root, root + ".away");
    std::ofstream(root) << "in the way";
    absl::Status saved = (*trainer)->Save(manifest);
    std::filesystem::remove(root);
    std::filesystem::rename(root + ".away", root);
    EXPECT_FALSE(saved.ok());
    std::ifstream in(manifest);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(all.find("step 1\n"), std::string::npos) << all;
  }
}

TEST_F(TrainerTest, BadOptionsFailBeforeAStepRuns) {
  auto client = cluster_->Connect();
  ASSERT_TRUE(client.ok());
  TrainOptions batch = Tiny();
  batch.batch = 6, batch.layout.data = 2, batch.microbatches = 2;
  auto t = Trainer::Create(**client, batch);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("multiple of 4"), std::string::npos) << t.status();
  TrainOptions stages = Tiny();
  stages.layout.stages = 3;
  t = Trainer::Create(**client, stages);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("3 pipeline stages for a model of 2 layers"), std::string::npos) << t.status();
  TrainOptions big = Tiny();
  big.layout.data = 8, big.layout.tensor = 2, big.batch = 16;
  t = Trainer::Create(**client, big);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  EXPECT_NE(t.status().message().find("stage 0's slice of 8 x 2 devices"), std::string::npos) << t.status();
  TrainOptions islands = Tiny();
  islands.islands = 3;
  t = Trainer::Create(**client, islands);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  // Factors of the batch's split that are zero, or whose product overflows (found by a hostile
  // try: both divided by zero).
  for (auto [data, microbatches] : {std::pair<int64_t, int64_t>{0, 1}, {1, 0}, {int64_t{1} << 62, 4}}) {
    TrainOptions zero = Tiny();
    zero.layout.data = data, zero.microbatches = microbatches;
    t = Trainer::Create(**client, zero);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find("must be between 1 and"), std::string::npos) << t.status();
  }
  for (auto [tensor, stages] : {std::pair<int64_t, int64_t>{0, 1}, {1, 0}}) {
    TrainOptions zero = Tiny();
    zero.layout.tensor = tensor, zero.layout.stages = stages;
    t = Trainer::Create(**client, zero);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find("must be between 1 and"), std::string::npos) << t.status();
  }
  // A learning rate that is no step size, and model sizes out of range, are refused by name (an
  // infinite rate reached the optimizer's source as `inf`; a negative vocabulary from Python was
  // taken for the preset's).
  for (double rate : {std::numeric_limits<double>::infinity(), std::nan(""), 0.0, -1e-3, 2.0}) {
    TrainOptions bad = Tiny();
    bad.adam.learning_rate = rate;
    t = Trainer::Create(**client, bad);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << rate;
    EXPECT_NE(t.status().message().find("learning rate"), std::string::npos) << t.status();
  }
  for (int64_t vocab : {int64_t{-3}, int64_t{1} << 40}) {
    TrainOptions bad = Tiny();
    bad.model.vocab = vocab;
    t = Trainer::Create(**client, bad);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << vocab << ": " << t.status();
  }
}

}  // namespace
}  // namespace pathways
