// The `pathways.*` torch ops that compiled functions call, but for the collectives
// (collective_ops.cc): random numbers, training data, checkpoint shards, Task Bench's kernel; and
// the built-in kernels.
#include "compute/torch_ops.h"

#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "collective/collective.h"
#include "compute/batch_prefetcher.h"
#include "compute/body_heap.h"
#include "compute/checkpoint_files.h"
#include "compute/counter_rng.h"
#include "compute/markov.h"
#include "compute/stop_request.h"
#include "compute/text_source.h"

namespace pathways {

absl::StatusOr<at::ScalarType> ToTorch(DType dtype) {
  switch (dtype) {
    case DType::kF32: return at::kFloat;
    case DType::kF64: return at::kDouble;
    case DType::kI32: return at::kInt;
    case DType::kI64: return at::kLong;
    case DType::kBool: return at::kBool;
    default: return absl::InvalidArgumentError(absl::StrCat("no torch type for ", DTypeName(dtype)));
  }
}

DType FromTorch(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kDouble: return DType::kF64;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kBool: return DType::kBool;
    default: return DType::kInvalid;
  }
}

namespace {

// Task Bench's compute-bound kernel (bench/task_bench.cc): `iterations` times y = y * a + b over
// every element, a plain loop, so that a task's duration grows with `iterations` and costs
// no op dispatch per iteration; bench/peers/mpi_stencil.c runs the same loop.
at::Tensor FmaLoop(const at::Tensor& x, int64_t iterations, double a, double b) {
  PW_OP_CHECK(x.scalar_type() == at::kFloat, "fma_loop needs a float tensor, not ", x.scalar_type());
  PW_OP_CHECK(iterations >= 0, "fma_loop: ", iterations, " iterations");
  // Its loop writes raw memory, which autograd would not see: refuse rather than differentiate
  // it as the identity.
  PW_OP_CHECK(!(at::GradMode::is_enabled() && x.requires_grad()), "fma_loop has no gradient");
  at::Tensor y = x.contiguous().clone();
  float* p = y.data_ptr<float>();
  const int64_t n = y.numel();
  const float fa = static_cast<float>(a), fb = static_cast<float>(b);
  for (int64_t k = 0; k < iterations; ++k) {
    PW_OP_CHECK(!StopRequested(), "fma_loop was asked to stop after ", k, " of ", iterations, " passes");
    for (int64_t j = 0; j < n; ++j) p[j] = p[j] * fa + fb;
  }
  return y;
}

// Random numbers (compute/counter_rng.h). `shape` is the shard's local shape and `spec` names,
// per dimension, the mesh axes that split it ("" or absent: not split; "x,y": both), as the
// output's partition spec does: each shard draws its block of one global array, so replicas
// agree and the pieces of a split array differ. Outside a slice every dimension is whole.
at::Tensor Random(RandomDistribution distribution, const std::vector<int64_t>& shape,
                  const std::vector<std::string>& spec, int64_t seed, int64_t step) {
  PW_OP_CHECK(spec.size() <= shape.size(), "random numbers: a spec of ", spec.size(), " entries for a shape of rank ",
              shape.size());
  std::vector<int64_t> global = shape, origin(shape.size(), 0);
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  for (size_t d = 0; d < shape.size(); ++d) {
    PW_OP_CHECK(shape[d] >= 0, "random numbers: dimension ", d, " of size ", shape[d]);
    if (d >= spec.size() || spec[d].empty() || shard == nullptr) continue;
    auto group = shard->GroupOver(spec[d]);
    PW_OP_CHECK(group.ok(), "random numbers: ", group.status().message());
    origin[d] = group->rank * shape[d];
    global[d] = shape[d] * static_cast<int64_t>(group->shards.size());
  }
  at::Tensor out = torch::empty(shape, at::kFloat);
  FillRandom(distribution, static_cast<uint64_t>(seed), static_cast<uint64_t>(step), global, origin, shape,
             out.data_ptr<float>());
  return out;
}

at::Tensor Uniform(std::vector<int64_t> shape, std::vector<std::string> spec, int64_t seed, int64_t step) {
  return Random(RandomDistribution::kUniform, shape, spec, seed, step);
}

at::Tensor Normal(std::vector<int64_t> shape, std::vector<std::string> spec, int64_t seed, int64_t step) {
  return Random(RandomDistribution::kNormal, shape, spec, seed, step);
}

// Zeroes each element with probability `p` and scales the rest by 1 / (1 - p); the mask is a
// uniform draw over `x`'s shape under `spec`, so it is the same wherever `x` is replicated.
at::Tensor Dropout(const at::Tensor& x, double p, std::vector<std::string> spec, int64_t seed, int64_t step) {
  PW_OP_CHECK(p >= 0 && p < 1, "dropout: probability ", p, " is not in [0, 1)");
  PW_OP_CHECK(at::isFloatingType(x.scalar_type()), "dropout needs a floating-point tensor");
  if (p == 0) return x;
  at::Tensor keep = Random(RandomDistribution::kUniform, x.sizes().vec(), spec, seed, step).ge(p);
  return x * keep.to(x.scalar_type()) / (1 - p);
}

// Where this shard's `batch` sequences of `length` tokens start in the global batch: at `first`
// plus its rank over `batch_axes` (the mesh axes splitting the batch; "" for none) times `batch`.
// Throws on sizes out of range.
int64_t ShardsFirstSequence(const char* op, int64_t batch, int64_t length, const std::string& batch_axes,
                            int64_t first) {
  TORCH_CHECK(batch >= 0 && length >= 0 && batch <= (int64_t{1} << 30) && length <= (int64_t{1} << 30) &&
                  batch * length <= (int64_t{1} << 30) && first >= 0 && first <= (int64_t{1} << 40),
              op, ": ", batch, " sequences of ", length, " tokens from sequence ", first);
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  if (shard == nullptr || batch_axes.empty()) return first;
  auto group = shard->GroupOver(batch_axes);
  TORCH_CHECK(group.ok(), op, ": ", group.status().message());
  return first + group->rank * batch;
}

// Token sequences of the built-in Markov data set (compute/markov.h): `batch` sequences of
// `length` tokens for this shard, whose place in the global batch is `first` plus its rank over
// `batch_axes` (the mesh axes splitting the batch; "" for none) times `batch`, so the shards of a
// batch hold its pieces (and microbatch k of a step starts at first = k x its size).
at::Tensor MarkovTokens(int64_t batch, int64_t length, int64_t vocab, int64_t chain_seed, int64_t data_seed,
                        int64_t step, std::string batch_axes, double sharpness, int64_t first) {
  TORCH_CHECK(vocab <= MarkovSource::kMaxVocab, "markov_tokens: a vocabulary of ", vocab, " tokens");
  first = ShardsFirstSequence("markov_tokens", batch, length, batch_axes, first);
  at::Tensor out = torch::empty({batch, length}, at::kLong);
  absl::Status drawn;
  {
    // The sources and the prefetcher are the runtime's, shared by every tenant's runs: reached,
    // and let go of, with the body's heap paused (compute/body_heap.h). The output is the body's.
    const BodyHeapPause runtime;
    auto source = MarkovSource::Get(static_cast<int>(vocab), static_cast<uint64_t>(chain_seed), sharpness);
    if (!source.ok()) {
      drawn = source.status();
    } else {
      // Drawn ahead on the host's prefetch thread: this shard's part of the next step's batch is
      // known (compute/batch_prefetcher.h). The sharpness by its bits: StrCat keeps 6 digits,
      // which two sources may share.
      const std::string key = absl::StrCat("markov/", vocab, "/", chain_seed, "/", absl::bit_cast<uint64_t>(sharpness),
                                           "/", data_seed, "/", first, "/", batch, "/", length);
      std::shared_ptr<const MarkovSource> chain = *std::move(source);
      drawn = BatchPrefetcher::Global().Get(
          key, static_cast<uint64_t>(step), static_cast<size_t>(batch * length),
          [chain, data_seed, first, batch, length](uint64_t s, int64_t* tokens) {
            chain->Sample(static_cast<uint64_t>(data_seed), s, first, batch, length, tokens);
            return absl::OkStatus();
          },
          out.data_ptr<int64_t>());
    }
  }
  TORCH_CHECK(drawn.ok(), "markov_tokens: ", drawn.message());
  return out;
}

// Token sequences of a text file on the worker's host (compute/text_source.h): bytes as tokens,
// this shard's `batch` sequences placed in the global batch as markov_tokens places them.
at::Tensor TextTokens(std::string path, int64_t batch, int64_t length, int64_t seed, int64_t step,
                      std::string batch_axes, int64_t first) {
  first = ShardsFirstSequence("text_tokens", batch, length, batch_axes, first);
  at::Tensor out = torch::empty({batch, length}, at::kLong);
  absl::Status sampled;
  {
    const BodyHeapPause runtime;  // as markov_tokens
    auto source = TextSource::Open(path);
    if (!source.ok()) {
      sampled = source.status();
    } else {
      // Drawn ahead as markov_tokens' batches are. The key names the file as opened (device,
      // inode, size, modification time), so a file changed since is drawn from again, not from
      // batches of what it was.
      std::shared_ptr<const TextSource> text = *std::move(source);
      const std::string key = absl::StrCat("text/", text->identity(), "/", seed, "/", first, "/", batch, "/", length);
      sampled = BatchPrefetcher::Global().Get(
          key, static_cast<uint64_t>(step), static_cast<size_t>(batch * length),
          [text, seed, first, batch, length](uint64_t s, int64_t* tokens) {
            return text->Sample(static_cast<uint64_t>(seed), s, first, batch, length, tokens);
          },
          out.data_ptr<int64_t>());
    }
  }
  if (!sampled.ok()) OpFailure() = sampled;
  TORCH_CHECK(sampled.ok(), "text_tokens: ", sampled.message());
  return out;
}

// Checkpoint shards (compute/checkpoint_files.h): each device writes and reads the shard it holds
// of an f32 array, named by the checkpoint's secret, the step and the array's name. save_shard
// returns a scalar 1 once the shard is on disk, for the caller to wait on.
int64_t ShardIndex() {
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  return shard == nullptr ? 0 : shard->shard();
}

at::Tensor SaveShard(const at::Tensor& x, std::string secret, int64_t step, std::string name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "save_shard: ", name, " is not f32");
  const at::Tensor data = x.contiguous();
  const absl::Status saved = [&] {
    const BodyHeapPause runtime;  // the checkpoint's files are the runtime's (compute/body_heap.h)
    return WriteCheckpointShard({secret, step, name, ShardIndex()}, DType::kF32,
                                Shape(data.sizes().begin(), data.sizes().end()), data.data_ptr(),
                                static_cast<int64_t>(data.nbytes()));
  }();
  if (!saved.ok()) OpFailure() = saved;
  TORCH_CHECK(saved.ok(), "save_shard: ", saved.message());
  return torch::ones({});
}

at::Tensor LoadShard(std::vector<int64_t> shape, std::string secret, int64_t step, std::string name) {
  at::Tensor out = torch::empty(shape, at::kFloat);
  const absl::Status loaded = [&] {
    const BodyHeapPause runtime;  // as save_shard
    return ReadCheckpointShard({secret, step, name, ShardIndex()}, DType::kF32, Shape(shape), out.data_ptr(),
                               static_cast<int64_t>(out.nbytes()));
  }();
  if (!loaded.ok()) OpFailure() = loaded;
  TORCH_CHECK(loaded.ok(), "load_shard: ", loaded.message());
  return out;
}

// Every op depends on where its shard runs (its group, its place in the mesh) and the
// collectives exchange data with other shards: none is a pure function of its arguments. They are
// registered as having side effects (conservative alias analysis), so TorchScript's optimiser
// never runs one at compile time on constant arguments (a collective run then, on one shard's
// thread, waited for members that waited for the optimiser; random numbers would have been one
// shard's, baked into every shard), merges two of them or drops one whose result is unused.
TORCH_LIBRARY(pathways, m) {
  auto op = [](const char* schema) { return torch::schema(schema, c10::AliasAnalysisKind::CONSERVATIVE); };
  m.def(op("uniform(int[] shape, str[] spec, int seed, int step) -> Tensor"), &Uniform);
  m.def(op("normal(int[] shape, str[] spec, int seed, int step) -> Tensor"), &Normal);
  m.def(op("dropout(Tensor x, float p, str[] spec, int seed, int step) -> Tensor"), &Dropout);
  m.def(op("markov_tokens(int batch, int length, int vocab, int chain_seed, int data_seed, int step, "
           "str batch_axes='', float sharpness=2.0, int first=0) -> Tensor"),
        &MarkovTokens);
  m.def(op("text_tokens(str path, int batch, int length, int seed, int step, str batch_axes='', int first=0) -> Tensor"),
        &TextTokens);
  m.def(op("save_shard(Tensor x, str secret, int step, str name) -> Tensor"), &SaveShard);
  m.def(op("load_shard(int[] shape, str secret, int step, str name) -> Tensor"), &LoadShard);
  m.def(op("fma_loop(Tensor x, int iterations, float a, float b) -> Tensor"), &FmaLoop);
}

// Built-in kernels. Collective ones take the mesh axes after an '@' in their name
// ("all_reduce_sum@x,y"); without one they span the whole mesh.
using V = std::vector<at::Tensor>;

const std::map<std::string, BuiltinKernel>& Builtins() {
  auto plain = [](int arity, std::function<V(const V&)> f) {
    return BuiltinKernel{arity, [f](const V& x, const std::string&) { return f(x); }};
  };
  auto collective = [](std::function<at::Tensor(const at::Tensor&, const std::string&)> f) {
    return BuiltinKernel{1, [f](const V& x, const std::string& axes) { return V{f(x[0], axes)}; }, true};
  };
  static const auto* kernels = new std::map<std::string, BuiltinKernel>{
      {"identity", plain(1, [](const V& x) { return V{x[0].clone()}; })},
      {"add_one", plain(1, [](const V& x) { return V{x[0] + 1}; })},
      {"negate", plain(1, [](const V& x) { return V{-x[0]}; })},
      {"relu", plain(1, [](const V& x) { return V{torch::relu(x[0])}; })},
      {"tanh", plain(1, [](const V& x) { return V{torch::tanh(x[0])}; })},
      {"add", plain(2, [](const V& x) { return V{x[0] + x[1]}; })},
      {"multiply", plain(2, [](const V& x) { return V{x[0] * x[1]}; })},
      {"matmul", plain(2, [](const V& x) { return V{torch::matmul(x[0], x[1])}; })},
      {"sum", plain(1, [](const V& x) { return V{x[0].sum()}; })},
      {"all_reduce_sum", collective([](const at::Tensor& x, const std::string& a) { return AllReduceOp(x, a, "sum"); })},
      {"all_reduce_max", collective([](const at::Tensor& x, const std::string& a) { return AllReduceOp(x, a, "max"); })},
      {"all_reduce_min", collective([](const at::Tensor& x, const std::string& a) { return AllReduceOp(x, a, "min"); })},
      {"all_reduce_mean", collective([](const at::Tensor& x, const std::string& a) { return AllReduceOp(x, a, "mean"); })},
      {"all_gather", collective([](const at::Tensor& x, const std::string& a) { return AllGatherOp(x, a, 0); })},
      {"reduce_scatter_sum",
       collective([](const at::Tensor& x, const std::string& a) { return ReduceScatterOp(x, a, "sum", 0); })},
      {"all_to_all", collective([](const at::Tensor& x, const std::string& a) { return AllToAllOp(x, a, 0); })},
      {"broadcast", collective([](const at::Tensor& x, const std::string& a) { return BroadcastOp(x, a, 0); })},
  };
  return *kernels;
}

}  // namespace

const std::map<std::string, BuiltinKernel>& BuiltinKernels() { return Builtins(); }

absl::Status& OpFailure() {
  thread_local absl::Status failure;
  return failure;
}

}  // namespace pathways
