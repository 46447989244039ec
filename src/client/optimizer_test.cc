#include "client/optimizer.h"

#include <cmath>

#include "client/program.h"
#include "compute/markov.h"
#include "cluster/local_cluster.h"
#include "gtest/gtest.h"
#include "testing/host_arrays.h"

namespace pathways {
namespace {

using testing::RandomF32;

HostArray Zeros(Shape shape) { return *HostArray::Create(DType::kF32, std::move(shape)); }

class OptimizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = LocalCluster::Start({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 2,
                                    .device_memory_bytes = 64 << 20})
                   ->release();
  }
  static void TearDownTestSuite() { delete cluster_; }
  void SetUp() override {
    client_ = *cluster_->Connect();
    slice_ = *client_->CreateSlice({.mesh_shape = {2, 2}});
  }
  static LocalCluster* cluster_;
  std::unique_ptr<Client> client_;
  VirtualSlice slice_;
};
LocalCluster* OptimizerTest::cluster_ = nullptr;

// Five steps of Adam (with weight decay) over a parameter split over both mesh axes, against the
// update written out here in double precision.
TEST_F(OptimizerTest, AdamMatchesTheUpdateWrittenOut) {
  const TensorSpec spec{DType::kF32, {8, 6}};
  const AdamOptions options{.learning_rate = 0.05, .beta1 = 0.8, .beta2 = 0.95, .epsilon = 1e-6, .weight_decay = 0.1};
  auto adam_spec = AdamUpdate(spec, {"x", "y"}, options);
  ASSERT_TRUE(adam_spec.ok()) << adam_spec.status();
  auto adam = client_->Compile(*adam_spec);
  ASSERT_TRUE(adam.ok()) << adam.status();
  HostArray p_host = RandomF32({8, 6}, 1);
  std::vector<double> p(p_host.data<float>(), p_host.data<float>() + 48), m(48, 0), v(48, 0);
  ShardedArray param = *client_->Put(p_host, slice_, {"x", "y"});
  ShardedArray m_arr = *client_->Put(Zeros({8, 6}), slice_, {"x", "y"});
  ShardedArray v_arr = *client_->Put(Zeros({8, 6}), slice_, {"x", "y"});
  ShardedArray count = *client_->Put(Zeros({}), slice_);
  for (int step = 1; step <= 5; ++step) {
    HostArray g = RandomF32({8, 6}, 100 + step);
    auto out = client_->Call(*adam, slice_, {param, *client_->Put(g, slice_, {"x", "y"}), m_arr, v_arr, count});
    ASSERT_TRUE(out.ok()) << out.status();
    param = (*out)[0];
    m_arr = (*out)[1];
    v_arr = (*out)[2];
    count = (*out)[3];
    for (int i = 0; i < 48; ++i) {
      const double gi = g.data<float>()[i];
      p[i] *= 1 - options.learning_rate * options.weight_decay;
      m[i] = options.beta1 * m[i] + (1 - options.beta1) * gi;
      v[i] = options.beta2 * v[i] + (1 - options.beta2) * gi * gi;
      const double m_hat = m[i] / (1 - std::pow(options.beta1, step));
      const double v_hat = v[i] / (1 - std::pow(options.beta2, step));
      p[i] -= options.learning_rate * m_hat / (std::sqrt(v_hat) + options.epsilon);
    }
  }
  auto got = client_->Fetch(param).Await();
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 48; ++i) EXPECT_NEAR(got->data<float>()[i], p[i], 1e-5) << i;
  EXPECT_EQ(client_->Fetch(count).Await()->data<float>()[0], 5);
}

TEST_F(OptimizerTest, BadOptionsAndParametersAreRefused) {
  EXPECT_FALSE(AdamUpdate({DType::kI32, {4}}, {}).ok());
  EXPECT_NE(AdamUpdate({DType::kF32, {4}}, {}, {.beta1 = 1}).status().message().find("betas"), std::string::npos);
  EXPECT_FALSE(AdamUpdate({DType::kF32, {4}}, {}, {.learning_rate = -1}).ok());
}

// A whole training step as one program: the loss's gradient (data-parallel: the batch split over
// x, the loss a mean over it) and Adam on the weights in place, run once per step. A least-squares
// fit whose exact answer is known: the loss falls to almost nothing.
TEST_F(OptimizerTest, AProgramOfGradientAndAdamFitsALinearModel) {
  const int64_t batch = 32, in = 6, out = 2;
  const std::string loss_source =
      "def loss(w, x, y):\n"
      "    d = x @ w - y\n"
      "    return pathways.all_reduce((d * d).sum(), 'x') / " + std::to_string(batch * out) + ".0\n";
  FunctionSpec loss = FunctionSpec::Script("loss", loss_source,
                                           {{DType::kF32, {in, out}}, {DType::kF32, {batch, in}}, {DType::kF32, {batch, out}}},
                                           {{DType::kF32, {}}}, {{}, {"x", ""}, {"x", ""}}, {{}});
  auto grad = client_->Compile(*FunctionSpec::Vjp(loss, {0}, /*with_outputs=*/true));
  ASSERT_TRUE(grad.ok()) << grad.status();
  auto adam = client_->Compile(*AdamUpdate({DType::kF32, {in, out}}, {}, {.learning_rate = 0.05}));
  ASSERT_TRUE(adam.ok()) << adam.status();

  ProgramBuilder b("train_step");
  TracedValue w = b.Arg({DType::kF32, {in, out}}), x = b.Arg({DType::kF32, {batch, in}}),
              y = b.Arg({DType::kF32, {batch, out}}), m = b.Arg({DType::kF32, {in, out}}),
              v = b.Arg({DType::kF32, {in, out}}), count = b.Arg({DType::kF32, {}}), one = b.Arg({DType::kF32, {}});
  auto lg = b.Call(*grad, slice_, {w, x, y, one});
  ASSERT_TRUE(lg.ok()) << lg.status();
  // The gradient reads w before Adam updates it in place: each device runs the gradient first,
  // and then hands w's buffer to Adam.
  auto updated = b.Call(*adam, slice_, {w, (*lg)[1], m, v, count});
  ASSERT_TRUE(updated.ok()) << updated.status();
  Program step = *b.Build({(*lg)[0], (*updated)[0], (*updated)[1], (*updated)[2], (*updated)[3]});

  HostArray x_host = RandomF32({batch, in}, 7), w_true = RandomF32({in, out}, 8);
  HostArray y_host = Zeros({batch, out});
  for (int64_t i = 0; i < batch; ++i) {
    for (int64_t j = 0; j < out; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < in; ++k) acc += x_host.data<float>()[i * in + k] * w_true.data<float>()[k * out + j];
      y_host.mutable_data<float>()[i * out + j] = acc;
    }
  }
  HostArray one_host = Zeros({});
  one_host.mutable_data<float>()[0] = 1;
  ShardedArray w_arr = *client_->Put(Zeros({in, out}), slice_), m_arr = *client_->Put(Zeros({in, out}), slice_),
               v_arr = *client_->Put(Zeros({in, out}), slice_), count_arr = *client_->Put(Zeros({}), slice_);
  ShardedArray x_arr = *client_->Put(x_host, slice_, {"x", ""}), y_arr = *client_->Put(y_host, slice_, {"x", ""}),
               one_arr = *client_->Put(one_host, slice_);
  std::vector<float> losses;
  for (int i = 0; i < 200; ++i) {
    auto r = client_->Run(step, {w_arr, x_arr, y_arr, m_arr, v_arr, count_arr, one_arr});
    ASSERT_TRUE(r.ok()) << r.status();
    if (i % 50 == 0 || i == 199) losses.push_back(client_->Fetch((*r)[0]).Await()->data<float>()[0]);
    w_arr = (*r)[1];
    m_arr = (*r)[2];
    v_arr = (*r)[3];
    count_arr = (*r)[4];
  }
  for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]) << i;
  EXPECT_LT(losses.back(), 1e-3 * losses.front()) << losses.front() << " -> " << losses.back();
}


// Data made where it is used: each device draws its part of every batch from the built-in Markov
// source (`pathways.markov_tokens`, the batch split over both mesh axes), and a bigram model
// trained on it with Adam comes within 10% of the source's entropy rate, the best loss there is.
// The step counter Adam keeps numbers the batches, so nothing but the first Put comes from the
// client.
TEST_F(OptimizerTest, ABigramModelLearnsTheMarkovSourceDownToItsEntropy) {
  const int64_t vocab = 16, local_batch = 4, length = 64;
  auto source = MarkovSource::Get(vocab, /*seed=*/3);
  ASSERT_TRUE(source.ok());
  const std::string body =
      "def bigram(table, step):\n"
      "    tokens = pathways.markov_tokens(" + std::to_string(local_batch) + ", " + std::to_string(length) + ", " +
      std::to_string(vocab) + ", 3, 1, int(step.item()), 'x,y')\n"
      "    logp = torch.log_softmax(table[tokens[:, :-1]], -1)\n"
      "    nll = -logp.gather(2, tokens[:, 1:].unsqueeze(2)).mean()\n"
      "    return pathways.all_reduce(nll, '', 'mean')\n";
  const TensorSpec table{DType::kF32, {vocab, vocab}}, scalar{DType::kF32, {}};
  FunctionSpec loss = FunctionSpec::Script("bigram", body, {table, scalar}, {scalar});
  auto grad = client_->Compile(*FunctionSpec::Vjp(loss, {0}, /*with_outputs=*/true));
  ASSERT_TRUE(grad.ok()) << grad.status();
  auto adam = client_->Compile(*AdamUpdate(table, {}, {.learning_rate = 0.05}));
  ASSERT_TRUE(adam.ok()) << adam.status();
  ProgramBuilder b("bigram_step");
  TracedValue w = b.Arg(table), m = b.Arg(table), v = b.Arg(table), count = b.Arg(scalar), one = b.Arg(scalar);
  auto lg = b.Call(*grad, slice_, {w, count, one});
  ASSERT_TRUE(lg.ok()) << lg.status();
  auto updated = b.Call(*adam, slice_, {w, (*lg)[1], m, v, count});
  ASSERT_TRUE(updated.ok()) << updated.status();
  Program step = *b.Build({(*lg)[0], (*updated)[0], (*updated)[1], (*updated)[2], (*updated)[3]});

  HostArray one_host = Zeros({});
  one_host.mutable_data<float>()[0] = 1;
  ShardedArray w_arr = *client_->Put(Zeros({vocab, vocab}), slice_), m_arr = *client_->Put(Zeros({vocab, vocab}), slice_),
               v_arr = *client_->Put(Zeros({vocab, vocab}), slice_), count_arr = *client_->Put(Zeros({}), slice_),
               one_arr = *client_->Put(one_host, slice_);
  std::vector<ShardedArray> losses;
  for (int i = 0; i < 400; ++i) {
    auto r = client_->Run(step, {w_arr, m_arr, v_arr, count_arr, one_arr});
    ASSERT_TRUE(r.ok()) << r.status();
    if (i == 0 || i >= 360) losses.push_back((*r)[0]);
    w_arr = (*r)[1];
    m_arr = (*r)[2];
    v_arr = (*r)[3];
    count_arr = (*r)[4];
  }
  const double first = client_->Fetch(losses[0]).Await()->data<float>()[0];
  double last = 0;
  for (size_t i = 1; i < losses.size(); ++i) last += client_->Fetch(losses[i]).Await()->data<float>()[0];
  last /= static_cast<double>(losses.size() - 1);
  const double entropy = (*source)->EntropyRate();
  EXPECT_NEAR(first, std::log(static_cast<double>(vocab)), 1e-4);  // a table of zeros: uniform
  EXPECT_LT(last, 1.1 * entropy) << "first " << first << ", last 40 steps " << last << ", entropy " << entropy;
  EXPECT_GT(last, 0.9 * entropy);
}

}  // namespace
}  // namespace pathways
