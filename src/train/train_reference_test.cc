// The runtime's training against the same model trained by plain libtorch in this process. The
// reference is written here from the model's description (train/transformer.h: pre-LayerNorm
// blocks, causal attention, GELU MLP, learned positions), with libtorch's C++ operators, not from
// the TorchScript the runtime compiles; it takes the same starting parameters (fetched from the
// devices that drew them), the same batches (drawn from the Markov source here), libtorch's
// autograd and torch::optim::Adam. The losses of the first steps must agree. Its attention masks
// every later position, so a runtime model that let a position see its successors (and read the
// token it predicts) would not match it.
#include <ATen/core/ivalue.h>  // before the other torch headers, for clang (see compute/torch_ops.h)
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>

#include "cluster/local_cluster.h"
#include "compute/markov.h"
#include "gtest/gtest.h"
#include "train/trainer.h"

namespace pathways {
namespace {

torch::Tensor ToTensor(const HostArray& a) {
  std::vector<int64_t> shape(a.shape().begin(), a.shape().end());
  return torch::from_blob(const_cast<char*>(a.bytes().data()), shape, torch::kFloat32).clone();
}

using Params = std::map<std::string, torch::Tensor>;

// Normalises over the last dimension, computed from its definition.
torch::Tensor LayerNorm(const torch::Tensor& x, const torch::Tensor& gain, const torch::Tensor& bias) {
  const torch::Tensor mean = x.mean(-1, /*keepdim=*/true);
  const torch::Tensor var = (x - mean).square().mean(-1, /*keepdim=*/true);
  return (x - mean) * torch::rsqrt(var + 1e-5) * gain + bias;
}

// GELU with the exact (erf) form.
torch::Tensor Gelu(const torch::Tensor& x) { return 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0))); }

// The mean cross-entropy of predicting tokens[:, i + 1] from tokens[:, 0..i], every i. Block
// parameters are stacked over layers (dimension 0), as the runtime holds them.
torch::Tensor ReferenceLoss(const TransformerConfig& c, const Params& p, const torch::Tensor& tokens) {
  const int64_t b = tokens.size(0), n = c.seq_len, heads = c.heads, dh = c.d_model / c.heads;
  const torch::Tensor input = tokens.slice(1, 0, n), target = tokens.slice(1, 1, n + 1);
  torch::Tensor x = p.at("tok_emb").index_select(0, input.reshape({-1})).view({b, n, c.d_model}) + p.at("pos_emb");
  const torch::Tensor later = torch::ones({n, n}, torch::kBool).triu(1);  // [i, j]: j comes after i
  for (int64_t l = 0; l < c.layers; ++l) {
    auto w = [&](const char* name) { return p.at(name).select(0, l); };
    const torch::Tensor h = LayerNorm(x, w("ln1_g"), w("ln1_b"));
    auto split = [&](const torch::Tensor& m) { return torch::matmul(h, m).view({b, n, heads, dh}).permute({0, 2, 1, 3}); };
    const torch::Tensor q = split(w("wq")), k = split(w("wk")), v = split(w("wv"));
    torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(dh));
    scores = scores.masked_fill(later, -std::numeric_limits<float>::infinity());
    const torch::Tensor heads_out = torch::matmul(torch::softmax(scores, -1), v);
    x = x + torch::matmul(heads_out.permute({0, 2, 1, 3}).reshape({b, n, c.d_model}), w("wo")) + w("bo");
    const torch::Tensor m = LayerNorm(x, w("ln2_g"), w("ln2_b"));
    x = x + torch::matmul(Gelu(torch::matmul(m, w("w1")) + w("b1")), w("w2")) + w("b2");
  }
  const torch::Tensor logits = torch::matmul(LayerNorm(x, p.at("lnf_g"), p.at("lnf_b")), p.at("head"));
  return torch::nn::functional::cross_entropy(logits.reshape({b * n, c.vocab}), target.reshape({-1}));
}

TEST(TrainReferenceTest, LossesMatchLibtorchTrainingTheSameModelInOneProcess) {
  auto cluster = LocalCluster::Start({.num_islands = 1, .hosts_per_island = 2, .devices_per_host = 2,
                                      .device_memory_bytes = 64 << 20});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto client = (*cluster)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  TrainOptions o;
  o.model.vocab = 32, o.model.d_model = 32, o.model.heads = 2, o.model.layers = 2, o.model.mlp_hidden = 64,
  o.model.seq_len = 16, o.model.init_seed = 9;
  o.batch = 8;
  o.chain_seed = 4, o.data_seed = 6;
  o.adam.learning_rate = 1e-2;
  // The runtime splits it every way; the reference below runs it whole.
  o.layout = {.data = 2, .tensor = 2, .stages = 1};
  auto trainer = Trainer::Create(**client, o);
  ASSERT_TRUE(trainer.ok()) << trainer.status();

  auto whole = BuildTransformer(o.model, {}, o.batch);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<TransformerParam>& names = whole->stages[0].params;
  const std::vector<ShardedArray> arrays = (*trainer)->Parameters(0);
  ASSERT_EQ(arrays.size(), names.size());
  std::vector<torch::Tensor> params;
  Params by_name;
  for (size_t i = 0; i < arrays.size(); ++i) {
    auto host = (*client)->Fetch(arrays[i]).Await();
    ASSERT_TRUE(host.ok()) << host.status();
    params.push_back(ToTensor(*host).requires_grad_(true));
    by_name[names[i].name] = params.back();
  }
  constexpr int kSteps = 5;
  std::vector<Future<double>> losses;
  for (int i = 0; i < kSteps; ++i) losses.push_back(*(*trainer)->Step());

  torch::optim::Adam adam(params, torch::optim::AdamOptions(o.adam.learning_rate)
                                      .betas({o.adam.beta1, o.adam.beta2})
                                      .eps(o.adam.epsilon));
  auto source = MarkovSource::Get(static_cast<int>(o.model.vocab), o.chain_seed, o.sharpness);
  ASSERT_TRUE(source.ok());
  for (int step = 0; step < kSteps; ++step) {
    torch::Tensor tokens = torch::empty({o.batch, o.model.seq_len + 1}, torch::kLong);
    (*source)->Sample(o.data_seed, step, 0, o.batch, o.model.seq_len + 1, tokens.data_ptr<int64_t>());
    adam.zero_grad();
    torch::Tensor loss = ReferenceLoss(o.model, by_name, tokens);
    loss.backward();
    adam.step();
    const double expected = loss.item<double>();
    ASSERT_TRUE(losses[step].Await().ok()) << losses[step].Await().status();
    EXPECT_NEAR(*losses[step].Await(), expected, 2e-4 * expected) << "step " << step;
  }
}

}  // namespace
}  // namespace pathways
