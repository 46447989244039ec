// The runtime's training against the same model trained by plain libtorch in this process: the
// model's one-device source compiled by torch::jit, the same starting parameters (fetched from the
// devices that drew them), the same batches (drawn from the Markov source here), libtorch's
// autograd and torch::optim::Adam. The losses of the first steps must agree.
#include <ATen/core/ivalue.h>  // before the other torch headers, for clang (see compute/torch_ops.h)
#include <torch/optim/adam.h>
#include <torch/jit.h>
#include <torch/script.h>

#include <cmath>

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

  std::vector<torch::Tensor> params;
  for (const ShardedArray& p : (*trainer)->Parameters(0)) {
    auto host = (*client)->Fetch(p).Await();
    ASSERT_TRUE(host.ok()) << host.status();
    params.push_back(ToTensor(*host).requires_grad_(true));
  }
  constexpr int kSteps = 5;
  std::vector<Future<double>> losses;
  for (int i = 0; i < kSteps; ++i) losses.push_back(*(*trainer)->Step());

  auto whole = BuildTransformer(o.model, {}, o.batch);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const FunctionSpec& forward = whole->stages[0].forward;
  auto unit = torch::jit::compile(forward.body.source);
  torch::jit::Function& loss_fn = unit->get_function(forward.body.name);
  torch::optim::Adam adam(params, torch::optim::AdamOptions(o.adam.learning_rate)
                                      .betas({o.adam.beta1, o.adam.beta2})
                                      .eps(o.adam.epsilon));
  auto source = MarkovSource::Get(static_cast<int>(o.model.vocab), o.chain_seed, o.sharpness);
  ASSERT_TRUE(source.ok());
  for (int step = 0; step < kSteps; ++step) {
    torch::Tensor tokens = torch::empty({o.batch, o.model.seq_len + 1}, torch::kLong);
    (*source)->Sample(o.data_seed, step, 0, o.batch, o.model.seq_len + 1, tokens.data_ptr<int64_t>());
    std::vector<c10::IValue> args = {tokens};
    for (const torch::Tensor& p : params) args.push_back(p);
    adam.zero_grad();
    torch::Tensor loss = loss_fn(args).toTensor();
    loss.backward();
    adam.step();
    const double expected = loss.item<double>();
    ASSERT_TRUE(losses[step].Await().ok()) << losses[step].Await().status();
    EXPECT_NEAR(*losses[step].Await(), expected, 2e-4 * expected) << "step " << step;
  }
}

}  // namespace
}  // namespace pathways
