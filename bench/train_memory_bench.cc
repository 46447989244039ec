// Peak device memory of a training step against what it must hold, counted by hand: an MLP
// (x @ W1 + b1 -> GELU -> @ W2 + b2, mean squared error) trained with Adam, the whole step (the
// loss's gradient, recomputing the forward pass, then Adam on every parameter) one program run
// per step on one device of an embedded cluster. Runs it with Adam updating parameters and
// moments in place (donated) and with Adam writing new ones, and prints both peaks beside the
// hand count. See docs/training.md.
//
//   build/bin/train_memory_bench [--batch 256] [--width 512] [--hidden 2048] [--steps 4]
#include <cstdio>
#include <string>
#include <vector>

#include "bench_util.h"
#include "client/optimizer.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "core/status_macros.h"
#include "testing/host_arrays.h"
#include "core/process.h"
#include "tools/flags.h"

namespace pathways {
namespace {

constexpr double kMiB = 1 << 20;

using testing::RandomF32;

struct Measured {
  double peak_mib = 0;
  double first_loss = 0, last_loss = 0;
};

absl::StatusOr<Measured> Train(LocalCluster& cluster, int64_t batch, int64_t width, int64_t hidden, int steps,
                               bool donate) {
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, cluster.Connect());
  PW_ASSIGN_OR_RETURN(VirtualSlice slice, client->CreateSlice({.mesh_shape = {1}}));
  const std::vector<TensorSpec> params = {
      {DType::kF32, {width, hidden}}, {DType::kF32, {hidden}}, {DType::kF32, {hidden, width}}, {DType::kF32, {width}}};
  const TensorSpec data{DType::kF32, {batch, width}}, scalar{DType::kF32, {}};
  FunctionSpec loss = FunctionSpec::Script("mlp_loss",
                                           "def mlp_loss(w1, b1, w2, b2, x, y):\n"
                                           "    h = torch.gelu(x @ w1 + b1)\n"
                                           "    d = h @ w2 + b2 - y\n"
                                           "    return (d * d).mean()\n",
                                           {params[0], params[1], params[2], params[3], data, data}, {scalar});
  PW_ASSIGN_OR_RETURN(FunctionSpec grad_spec, FunctionSpec::Vjp(loss, {0, 1, 2, 3}, /*with_outputs=*/true));
  PW_ASSIGN_OR_RETURN(CompiledFunction grad, client->Compile(grad_spec));
  std::vector<CompiledFunction> adam;
  for (const TensorSpec& p : params) {
    PW_ASSIGN_OR_RETURN(FunctionSpec spec, AdamUpdate(p, {}, {.learning_rate = 1e-3}));
    if (!donate) spec.donated_inputs.clear();
    PW_ASSIGN_OR_RETURN(CompiledFunction fn, client->Compile(spec));
    adam.push_back(fn);
  }
  // Arguments: 4 parameters, x, y, the loss's cotangent, then per parameter m, v, count.
  ProgramBuilder b("train_step");
  std::vector<TracedValue> w, m, v, count;
  for (const TensorSpec& p : params) w.push_back(b.Arg(p));
  TracedValue x = b.Arg(data), y = b.Arg(data), one = b.Arg(scalar);
  for (const TensorSpec& p : params) {
    m.push_back(b.Arg(p));
    v.push_back(b.Arg(p));
    count.push_back(b.Arg(scalar));
  }
  PW_ASSIGN_OR_RETURN(auto lg, b.Call(grad, slice, {w[0], w[1], w[2], w[3], x, y, one}));
  std::vector<TracedValue> results = {lg[0]};
  for (size_t i = 0; i < params.size(); ++i) {
    PW_ASSIGN_OR_RETURN(auto u, b.Call(adam[i], slice, {w[i], lg[1 + i], m[i], v[i], count[i]}));
    results.insert(results.end(), u.begin(), u.end());
  }
  PW_ASSIGN_OR_RETURN(Program step, b.Build(results));

  std::vector<ShardedArray> state;  // w0..w3, then m, v, count per parameter
  for (size_t i = 0; i < params.size(); ++i) {
    PW_ASSIGN_OR_RETURN(ShardedArray a, client->Put(RandomF32(params[i].shape, static_cast<uint32_t>(i), 0.05f), slice));
    state.push_back(a);
  }
  for (const TensorSpec& p : params) {
    for (const TensorSpec& s : {p, p, scalar}) {
      PW_ASSIGN_OR_RETURN(ShardedArray a, client->Put(*HostArray::Create(DType::kF32, s.shape), slice));
      state.push_back(a);
    }
  }
  PW_ASSIGN_OR_RETURN(ShardedArray x_arr, client->Put(RandomF32(data.shape, 10, 1), slice));
  PW_ASSIGN_OR_RETURN(ShardedArray y_arr, client->Put(RandomF32(data.shape, 11, 1), slice));
  HostArray one_host = *HostArray::Create(DType::kF32, {});
  one_host.mutable_data<float>()[0] = 1;
  PW_ASSIGN_OR_RETURN(ShardedArray one_arr, client->Put(one_host, slice));

  Device& device = cluster.worker(0).runtime().device(0);
  Measured measured;
  for (int s = 0; s <= steps; ++s) {
    if (s == 1) device.ResetMemoryPeak();  // step 0 warms up (compiles, first allocations)
    std::vector<ShardedArray> args(state.begin(), state.begin() + 4);
    args.insert(args.end(), {x_arr, y_arr, one_arr});
    args.insert(args.end(), state.begin() + 4, state.end());
    PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> out, client->Run(step, args));
    PW_ASSIGN_OR_RETURN(HostArray loss_value, client->Fetch(out[0]).Await());
    if (s == 0) measured.first_loss = loss_value.data<float>()[0];
    measured.last_loss = loss_value.data<float>()[0];
    // Results per parameter: new w, m, v, count.
    for (size_t i = 0; i < params.size(); ++i) {
      state[i] = out[1 + 4 * i];
      state[4 + 3 * i] = out[2 + 4 * i];
      state[5 + 3 * i] = out[3 + 4 * i];
      state[6 + 3 * i] = out[4 + 4 * i];
    }
  }
  measured.peak_mib = static_cast<double>(device.stats().memory_peak) / kMiB;
  return measured;
}

int Main(int argc, char** argv) {
  InitServingProcess();
  const Flags flags = bench::FlagsOrExit(argc, argv, {"batch", "width", "hidden", "steps"});
  auto batch = flags.GetInt("batch", 256), width = flags.GetInt("width", 512), hidden = flags.GetInt("hidden", 2048),
       steps = flags.GetInt("steps", 4);
  for (const auto* v : {&batch, &width, &hidden, &steps}) {
    if (!v->ok() || **v < 1 || **v > 16384) {
      std::fprintf(stderr, "--batch, --width, --hidden and --steps take integers from 1 to 16384\n");
      return 2;
    }
  }
  const double B = static_cast<double>(*batch), d = static_cast<double>(*width), f = static_cast<double>(*hidden);
  const double params = (d * f + f + f * d + d) * 4 / kMiB;
  const double data = 2 * B * d * 4 / kMiB;
  const double saved = (2 * B * f + B * d) * 4 / kMiB;  // GELU's input and output, the error
  const double hand = params /* parameters */ + params /* gradients */ + 2 * params /* Adam's moments */ + data + saved;
  auto cluster = LocalCluster::Start({.num_islands = 1, .hosts_per_island = 1, .devices_per_host = 1,
                                      .device_memory_bytes = int64_t{8} << 30});
  if (!cluster.ok()) {
    std::fprintf(stderr, "%s\n", std::string(cluster.status().message()).c_str());
    return 1;
  }
  std::printf("MLP %lldx%lld, batch %lld, f32, Adam; one device; peak over %lld steps after one warm-up step\n",
              static_cast<long long>(*width), static_cast<long long>(*hidden), static_cast<long long>(*batch),
              static_cast<long long>(*steps));
  std::printf("by hand (MiB): parameters %.1f, gradients %.1f, Adam moments %.1f, x and y %.1f, activations kept for "
              "the backward pass %.1f: %.1f\n",
              params, params, 2 * params, data, saved, hand);
  std::printf("| Adam | peak device memory (MiB) | peak / by hand | loss first -> last |\n|---|---|---|---|\n");
  bench::RowProgress progress("training steps", 2);  // on a terminal, on stderr
  for (bool donate : {true, false}) {
    progress.Measuring(donate ? "Adam in place" : "Adam into new buffers");
    auto m = Train(**cluster, *batch, *width, *hidden, static_cast<int>(*steps), donate);
    progress.Printing();
    if (!m.ok()) {
      std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
      return 1;
    }
    std::printf("| %s | %.1f | %.2f | %.4f -> %.4f |\n", donate ? "in place (donated)" : "new buffers", m->peak_mib,
                m->peak_mib / hand, m->first_loss, m->last_loss);
  }
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }
