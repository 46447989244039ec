// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/library.h>
#include <torch/script.h>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "collective/collective.h"
#include "compute/counter_rng.h"
#include "compute/markov.h"
#include "compute/executable.h"
#include "core/status_macros.h"
#include "device/host_memory.h"

namespace pathways {
namespace {

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

// The allocation a kernel on this thread was refused (device memory), if any.
absl::Status& KernelMemoryFailure() {
  thread_local absl::Status failure;
  return failure;
}

// Whether `t`'s storage and `buffer` overlap.
bool SharesMemory(const at::Tensor& t, const DeviceBuffer& buffer) {
  if (!t.defined() || !t.has_storage()) return false;
  const char* begin = static_cast<const char*>(t.storage().data());
  const char* end = begin + t.storage().nbytes();
  return begin < buffer.data() + buffer.byte_size() && buffer.data() < end;
}

at::Tensor View(const DeviceBuffer& buffer) {
  return torch::from_blob(const_cast<char*>(buffer.data()), buffer.shape(),
                          torch::TensorOptions().dtype(*ToTorch(buffer.dtype())));
}

// Collectives, as torch ops: `pathways.all_reduce(x, "x")` in TorchScript, and the collective
// built-in kernels. Each hands the shard's contiguous input and a fresh output to the runtime
// (collective/collective.h), which moves and reduces the bytes in place. Collectives along a
// dimension other than 0 move that dimension to the front first, so that the chunks members
// exchange are contiguous. Failures throw, as torch ops do; the executable turns them back into
// the collective's Status.

collective::ShardCollectives& CurrentShard() {
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  TORCH_CHECK(shard != nullptr, "pathways collectives run only inside a compiled function running on a slice");
  return *shard;
}

int GroupSize(const std::string& axes) {
  auto size = CurrentShard().GroupSize(axes);
  TORCH_CHECK(size.ok(), size.status().ToString());
  return *size;
}

// Runs `kind` with `x` (contiguous) as input and `out` as output. Collectives that only move
// data take any element type, as bytes; reductions need one the runtime can add.
void RunCollective(collective::CollectiveKind kind, const std::string& axes, const at::Tensor& x, at::Tensor& out,
                   collective::ReduceOp op = collective::ReduceOp::kSum, int root = 0) {
  const bool reduces =
      kind == collective::CollectiveKind::kAllReduce || kind == collective::CollectiveKind::kReduceScatter;
  DType dtype = FromTorch(x.scalar_type());
  size_t count = static_cast<size_t>(x.numel());
  if (!reduces) {
    dtype = DType::kBool;  // one byte per element
    count = x.nbytes();
  }
  TORCH_CHECK(dtype != DType::kInvalid, collective::CollectiveName(kind), ": cannot reduce tensors of type ",
              x.scalar_type());
  collective::CollectiveCall call;
  call.kind = kind;
  call.dtype = dtype;
  call.op = op;
  call.root = root;
  call.count = count;
  call.in = static_cast<const char*>(x.data_ptr());
  call.out = static_cast<char*>(out.data_ptr());
  absl::Status s = CurrentShard().Run(axes, call);
  TORCH_CHECK(s.ok(), s.ToString());
}

void CheckDim(const at::Tensor& x, int64_t dim, const char* what) {
  TORCH_CHECK(dim >= 0 && dim < x.dim(), what, ": dimension ", dim, " is not in a tensor of rank ", x.dim());
}

void CheckSplits(const at::Tensor& x, int64_t dim, int members, const char* what) {
  CheckDim(x, dim, what);
  TORCH_CHECK(x.size(dim) % members == 0, what, ": dimension ", dim, " of size ", x.size(dim),
              " does not split into ", members, " equal chunks");
}

at::Tensor AllReduceRaw(const at::Tensor& x, const std::string& axes, const std::string& op) {
  const bool mean = op == "mean";
  TORCH_CHECK(!mean || at::isFloatingType(x.scalar_type()), "all_reduce 'mean' needs a floating-point tensor");
  auto reduce = collective::ParseReduceOp(mean ? "sum" : op);
  TORCH_CHECK(reduce.ok(), reduce.status().message());
  at::Tensor in = x.contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kAllReduce, axes, in, out, *reduce);
  if (mean) out.div_(GroupSize(axes));
  return out;
}

at::Tensor AllGatherRaw(const at::Tensor& x, const std::string& axes, int64_t dim) {
  CheckDim(x, dim, "all_gather");
  const int members = GroupSize(axes);
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] *= members;
  at::Tensor out = torch::empty(sizes, in.options());
  RunCollective(collective::CollectiveKind::kAllGather, axes, in, out);
  return out.movedim(0, dim);
}

at::Tensor ReduceScatterRaw(const at::Tensor& x, const std::string& axes, const std::string& op, int64_t dim) {
  auto reduce = collective::ParseReduceOp(op);
  TORCH_CHECK(reduce.ok(), reduce.status().message());
  const int members = GroupSize(axes);
  CheckSplits(x, dim, members, "reduce_scatter");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] /= members;
  at::Tensor out = torch::empty(sizes, in.options());
  RunCollective(collective::CollectiveKind::kReduceScatter, axes, in, out, *reduce);
  return out.movedim(0, dim);
}

// Chunk j of member i's tensor goes to member j, which concatenates its chunks in member order.
at::Tensor AllToAllRaw(const at::Tensor& x, const std::string& axes, int64_t dim) {
  CheckSplits(x, dim, GroupSize(axes), "all_to_all");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kAllToAll, axes, in, out);
  return out.movedim(0, dim);
}

at::Tensor BroadcastRaw(const at::Tensor& x, const std::string& axes, int64_t root) {
  const int members = GroupSize(axes);
  TORCH_CHECK(root >= 0 && root < members, "broadcast: root ", root, " is not a member of a group of ", members);
  at::Tensor in = x.contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kBroadcast, axes, in, out, collective::ReduceOp::kSum,
                static_cast<int>(root));
  return out;
}

// Gradients of the collectives (their transposes), for bodies differentiated by a gradient body.
// A value replicated over a group carries, per shard, a part of its cotangent: the cotangent of
// the global value is the sum of the parts (see FunctionBody::Gradient). So all_reduce(sum)
// transposes to all_reduce(sum), all_gather to reduce_scatter(sum) and back, all_to_all to
// itself, and broadcast to a sum that lands on the root.
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct AllReduceGrad : torch::autograd::Function<AllReduceGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, const std::string& op) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["op"] = op;
    return AllReduceRaw(x, axes, op);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    TORCH_CHECK(op == "sum" || op == "mean", "all_reduce '", op, "' has no gradient (only 'sum' and 'mean' do)");
    return {AllReduceRaw(g[0], ctx->saved_data["axes"].toStringRef(), op), at::Tensor(), at::Tensor()};
  }
};

struct AllGatherGrad : torch::autograd::Function<AllGatherGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t dim) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["dim"] = dim;
    return AllGatherRaw(x, axes, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    return {ReduceScatterRaw(g[0], ctx->saved_data["axes"].toStringRef(), "sum", ctx->saved_data["dim"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterGrad : torch::autograd::Function<ReduceScatterGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, const std::string& op,
                            int64_t dim) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["op"] = op;
    ctx->saved_data["dim"] = dim;
    return ReduceScatterRaw(x, axes, op, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    TORCH_CHECK(op == "sum", "reduce_scatter '", op, "' has no gradient (only 'sum' does)");
    return {AllGatherRaw(g[0], ctx->saved_data["axes"].toStringRef(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

struct AllToAllGrad : torch::autograd::Function<AllToAllGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t dim) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["dim"] = dim;
    return AllToAllRaw(x, axes, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    return {AllToAllRaw(g[0], ctx->saved_data["axes"].toStringRef(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};

struct BroadcastGrad : torch::autograd::Function<BroadcastGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t root) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["root"] = root;
    return BroadcastRaw(x, axes, root);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string axes = ctx->saved_data["axes"].toStringRef();
    at::Tensor sum = AllReduceRaw(g[0], axes, "sum");
    auto group = CurrentShard().GroupOver(axes);
    TORCH_CHECK(group.ok(), group.status().ToString());
    if (group->rank != ctx->saved_data["root"].toInt()) sum.zero_();
    return {sum, at::Tensor(), at::Tensor()};
  }
};

at::Tensor AllReduce(const at::Tensor& x, std::string axes, std::string op) { return AllReduceGrad::apply(x, axes, op); }
at::Tensor AllGather(const at::Tensor& x, std::string axes, int64_t dim) { return AllGatherGrad::apply(x, axes, dim); }
at::Tensor ReduceScatter(const at::Tensor& x, std::string axes, std::string op, int64_t dim) {
  return ReduceScatterGrad::apply(x, axes, op, dim);
}
at::Tensor AllToAll(const at::Tensor& x, std::string axes, int64_t dim) { return AllToAllGrad::apply(x, axes, dim); }
at::Tensor Broadcast(const at::Tensor& x, std::string axes, int64_t root) {
  return BroadcastGrad::apply(x, axes, root);
}

// Random numbers (compute/counter_rng.h). `shape` is the shard's local shape and `spec` names,
// per dimension, the mesh axes that split it ("" or absent: not split; "x,y": both), as the
// output's partition spec does: each shard draws its block of one global array, so replicas
// agree and the pieces of a split array differ. Outside a slice every dimension is whole.
at::Tensor Random(RandomDistribution distribution, const std::vector<int64_t>& shape,
                  const std::vector<std::string>& spec, int64_t seed, int64_t step) {
  TORCH_CHECK(spec.size() <= shape.size(), "random numbers: a spec of ", spec.size(), " entries for a shape of rank ",
              shape.size());
  std::vector<int64_t> global = shape, origin(shape.size(), 0);
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 0, "random numbers: dimension ", d, " of size ", shape[d]);
    if (d >= spec.size() || spec[d].empty() || shard == nullptr) continue;
    auto group = shard->GroupOver(spec[d]);
    TORCH_CHECK(group.ok(), "random numbers: ", group.status().message());
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
  TORCH_CHECK(p >= 0 && p < 1, "dropout: probability ", p, " is not in [0, 1)");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "dropout needs a floating-point tensor");
  if (p == 0) return x;
  at::Tensor keep = Random(RandomDistribution::kUniform, x.sizes().vec(), spec, seed, step).ge(p);
  return x * keep.to(x.scalar_type()) / (1 - p);
}

// Token sequences of the built-in Markov data set (compute/markov.h): `batch` sequences of
// `length` tokens for this shard, whose place in the global batch is its rank over `batch_axes`
// (the mesh axes splitting the batch; "" for none), so the shards of a batch hold its pieces.
at::Tensor MarkovTokens(int64_t batch, int64_t length, int64_t vocab, int64_t chain_seed, int64_t data_seed,
                        int64_t step, std::string batch_axes, double sharpness) {
  TORCH_CHECK(batch >= 0 && length >= 0 && batch <= (int64_t{1} << 30) && length <= (int64_t{1} << 30) &&
                  batch * length <= (int64_t{1} << 30),
              "markov_tokens: ", batch, " sequences of ", length, " tokens");
  TORCH_CHECK(vocab <= MarkovSource::kMaxVocab, "markov_tokens: a vocabulary of ", vocab, " tokens");
  auto source = MarkovSource::Get(static_cast<int>(vocab), static_cast<uint64_t>(chain_seed), sharpness);
  TORCH_CHECK(source.ok(), "markov_tokens: ", source.status().message());
  int64_t first = 0;
  if (collective::ShardCollectives* shard = collective::ShardCollectives::Current();
      shard != nullptr && !batch_axes.empty()) {
    auto group = shard->GroupOver(batch_axes);
    TORCH_CHECK(group.ok(), "markov_tokens: ", group.status().message());
    first = group->rank * batch;
  }
  at::Tensor out = torch::empty({batch, length}, at::kLong);
  (*source)->Sample(static_cast<uint64_t>(data_seed), static_cast<uint64_t>(step), first, batch, length,
                    out.data_ptr<int64_t>());
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
           "str batch_axes='', float sharpness=2.0) -> Tensor"),
        &MarkovTokens);
  m.def(op("all_reduce(Tensor x, str axes='', str op='sum') -> Tensor"), &AllReduce);
  m.def(op("all_gather(Tensor x, str axes='', int dim=0) -> Tensor"), &AllGather);
  m.def(op("reduce_scatter(Tensor x, str axes='', str op='sum', int dim=0) -> Tensor"), &ReduceScatter);
  m.def(op("all_to_all(Tensor x, str axes='', int dim=0) -> Tensor"), &AllToAll);
  m.def(op("broadcast(Tensor x, str axes='', int root=0) -> Tensor"), &Broadcast);
}

// Built-in kernels. Collective ones take the mesh axes after an '@' in their name
// ("all_reduce_sum@x,y"); without one they span the whole mesh.
using V = std::vector<at::Tensor>;
using Kernel = std::function<V(const V&, const std::string& axes)>;

struct BuiltinKernel {
  int arity;
  Kernel fn;
  bool collective = false;
};

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
      {"all_reduce_sum", collective([](const at::Tensor& x, const std::string& a) { return AllReduce(x, a, "sum"); })},
      {"all_reduce_max", collective([](const at::Tensor& x, const std::string& a) { return AllReduce(x, a, "max"); })},
      {"all_reduce_min", collective([](const at::Tensor& x, const std::string& a) { return AllReduce(x, a, "min"); })},
      {"all_reduce_mean", collective([](const at::Tensor& x, const std::string& a) { return AllReduce(x, a, "mean"); })},
      {"all_gather", collective([](const at::Tensor& x, const std::string& a) { return AllGather(x, a, 0); })},
      {"reduce_scatter_sum",
       collective([](const at::Tensor& x, const std::string& a) { return ReduceScatter(x, a, "sum", 0); })},
      {"all_to_all", collective([](const at::Tensor& x, const std::string& a) { return AllToAll(x, a, 0); })},
      {"broadcast", collective([](const at::Tensor& x, const std::string& a) { return Broadcast(x, a, 0); })},
  };
  return *kernels;
}

// Script source sees the collectives as `pathways.<op>`.
class PathwaysResolver : public torch::jit::Resolver {
 public:
  std::shared_ptr<torch::jit::SugaredValue> resolveValue(const std::string& name, torch::jit::GraphFunction& m,
                                                         const torch::jit::SourceRange& loc) override {
    if (name == "pathways") return std::make_shared<torch::jit::BuiltinModule>("pathways");
    return torch::jit::nativeResolver()->resolveValue(name, m, loc);
  }
  c10::TypePtr resolveType(const std::string& name, const torch::jit::SourceRange& loc) override {
    return torch::jit::nativeResolver()->resolveType(name, loc);
  }
};

// Runs the body-specific part; the common part (viewing, checking, copying out) is shared.
class TorchExecutable : public Executable {
 public:
  explicit TorchExecutable(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }

  absl::Status Run(absl::Span<const DeviceBuffer* const> inputs,
                   absl::Span<DeviceBuffer* const> outputs) const override {
    std::vector<at::Tensor> results;
    KernelMemoryFailure() = absl::OkStatus();
    try {
      // Bodies run without autograd's bookkeeping, except those that differentiate: their
      // inputs must not be inference tensors, which autograd cannot record.
      c10::optional<c10::InferenceMode> inference;
      if (!differentiates()) inference.emplace();
      std::vector<at::Tensor> args;
      args.reserve(inputs.size());
      for (const DeviceBuffer* b : inputs) args.push_back(View(*b));
      auto r = Invoke(args);
      if (!r.ok()) return r.status();
      results = std::move(*r);
      if (results.size() != outputs.size()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name_, "' returned ",
                                                       results.size(), " values, its signature has ",
                                                       outputs.size(), " outputs"));
      }
      // An output that takes a donated input's buffer is written over that input: a result that
      // is a view of it (returned unchanged, say) is copied out before any output is written.
      for (size_t i = 0; i < results.size(); ++i) {
        for (size_t m = 0; m < outputs.size(); ++m) {
          if (m != i && SharesMemory(results[i], *outputs[m])) {
            results[i] = results[i].clone();
            break;
          }
        }
      }
      for (size_t i = 0; i < results.size(); ++i) {
        at::Tensor t = results[i].contiguous();
        DeviceBuffer& out = *outputs[i];
        Shape shape(t.sizes().begin(), t.sizes().end());
        DType dtype = FromTorch(t.scalar_type());
        if (dtype != out.dtype() || shape != out.shape()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "function '", name_, "' output ", i, " is ", DTypeName(dtype), ShapeToString(shape),
              " but its signature says ", DTypeName(out.dtype()), ShapeToString(out.shape()),
              " (local shard)"));
        }
        if (t.data_ptr() != out.data()) std::memmove(out.data(), t.data_ptr(), static_cast<size_t>(out.byte_size()));
      }
    } catch (const std::exception& e) {
      // The TorchScript interpreter rethrows what a kernel threw as its own error: a refused
      // allocation is known by what the allocator recorded.
      if (!KernelMemoryFailure().ok()) {
        absl::Status refused = std::exchange(KernelMemoryFailure(), absl::OkStatus());
        return absl::ResourceExhaustedError(
            absl::StrCat("function '", name_, "' ran out of device memory: ", refused.message()));
      }
      // A collective that failed keeps its code (DeadlineExceeded, Unavailable, ...).
      collective::ShardCollectives* shard = collective::ShardCollectives::Current();
      if (shard != nullptr && !shard->first_error().ok()) {
        return absl::Status(shard->first_error().code(), absl::StrCat("function '", name_, "' failed in a collective: ",
                                                                        shard->first_error().message()));
      }
      return absl::InternalError(
          absl::StrCat("function '", name_, "' failed at run time: ", e.what()));
    }
    return absl::OkStatus();
  }

  // Runs the body on torch views of the inputs.
  virtual absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const = 0;

 protected:
  virtual bool differentiates() const { return false; }

 private:
  std::string name_;
};

class BuiltinExecutable : public TorchExecutable {
 public:
  BuiltinExecutable(std::string name, const BuiltinKernel& kernel, std::string axes)
      : TorchExecutable(std::move(name)), kernel_(kernel), axes_(std::move(axes)) {}

 public:
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const override {
    if (static_cast<int>(args.size()) != kernel_.arity) {
      return absl::InvalidArgumentError(absl::StrCat("built-in kernel '", name(), "' takes ",
                                                     kernel_.arity, " inputs, got ", args.size()));
    }
    return kernel_.fn(args, axes_);
  }

 private:
  const BuiltinKernel& kernel_;
  const std::string axes_;
};

class ScriptExecutable : public TorchExecutable {
 public:
  ScriptExecutable(std::string name, std::shared_ptr<torch::jit::CompilationUnit> unit,
                   torch::jit::Function* function)
      : TorchExecutable(std::move(name)), unit_(std::move(unit)), function_(function) {}

 public:
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const override {
    std::vector<c10::IValue> stack(args.begin(), args.end());
    c10::IValue result = (*function_)(std::move(stack));
    std::vector<at::Tensor> out;
    if (result.isTensor()) {
      out.push_back(result.toTensor());
    } else if (result.isTuple()) {
      for (const auto& v : result.toTupleRef().elements()) {
        if (!v.isTensor()) return NotTensor();
        out.push_back(v.toTensor());
      }
    } else if (result.isTensorList()) {
      for (const at::Tensor& t : result.toTensorVector()) out.push_back(t);
    } else {
      return NotTensor();
    }
    return out;
  }

 private:
  absl::Status NotTensor() const {
    return absl::InvalidArgumentError(
        absl::StrCat("function '", name(), "' must return a tensor or a tuple of tensors"));
  }
  std::shared_ptr<torch::jit::CompilationUnit> unit_;
  torch::jit::Function* function_;
};


// The vector-Jacobian product of a primal body (FunctionBody::Gradient). The forward pass runs
// again here under autograd rather than keeping its residuals from an earlier call: a residual
// would be one more output per intermediate, held on the device between the forward and the
// backward call (for every microbatch in flight, in a pipeline), and tied to how the primal was
// written; recomputing costs one more forward pass and keeps the primal's signature as the user
// wrote it (GPipe rematerialises the same way). Random ops draw from counters, so the recomputed
// pass sees the same numbers as the original one.
class VjpExecutable : public TorchExecutable {
 public:
  VjpExecutable(std::string name, std::shared_ptr<const TorchExecutable> primal, FunctionBody::Gradient gradient)
      : TorchExecutable(std::move(name)), primal_(std::move(primal)), gradient_(std::move(gradient)) {}

  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const override {
    const size_t num_inputs = gradient_.in_specs.size();
    if (args.size() < num_inputs) return Invalid(absl::StrCat("takes at least ", num_inputs, " inputs, got ", args.size()));
    std::vector<at::Tensor> primal_args(args.begin(), args.begin() + static_cast<std::ptrdiff_t>(num_inputs));
    std::vector<at::Tensor> wrt;
    for (int i : gradient_.wrt) {
      at::Tensor& x = primal_args[static_cast<size_t>(i)];
      if (!at::isFloatingType(x.scalar_type())) {
        return Invalid(absl::StrCat("input ", i, " is not floating point and has no gradient"));
      }
      x = x.detach().requires_grad_(true);
      wrt.push_back(x);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad(true);
      PW_ASSIGN_OR_RETURN(outputs, primal_->Invoke(primal_args));
    }
    if (outputs.size() != gradient_.out_specs.size()) {
      return Invalid(absl::StrCat("its primal returned ", outputs.size(), " values, its signature has ",
                                  gradient_.out_specs.size(), " outputs"));
    }
    // One cotangent per floating-point output, each shared among the output's replicas.
    std::vector<at::Tensor> differentiated, seeds;
    size_t next = num_inputs;
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (!at::isFloatingType(outputs[k].scalar_type())) continue;
      if (next >= args.size()) return Invalid(absl::StrCat("has no cotangent for output ", k));
      const at::Tensor& cotangent = args[next++];
      if (cotangent.sizes() != outputs[k].sizes() || cotangent.scalar_type() != outputs[k].scalar_type()) {
        return Invalid(absl::StrCat("the cotangent of output ", k, " is ", c10::toString(cotangent.scalar_type()),
                                    c10::str(cotangent.sizes()), " but the output is ",
                                    c10::toString(outputs[k].scalar_type()), c10::str(outputs[k].sizes())));
      }
      if (!outputs[k].requires_grad()) continue;  // does not depend on what is differentiated
      differentiated.push_back(outputs[k]);
      const int replicas = Replicas(gradient_.out_specs[k]);
      seeds.push_back(replicas == 1 ? cotangent : cotangent / replicas);
    }
    if (next != args.size()) {
      return Invalid(absl::StrCat("takes ", next, " inputs (", num_inputs, " and one cotangent per floating-point output), got ",
                                  args.size()));
    }
    std::vector<at::Tensor> grads(wrt.size());
    if (!differentiated.empty() && !wrt.empty()) {
      grads = torch::autograd::grad(differentiated, wrt, seeds, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    }
    std::vector<at::Tensor> results;
    if (gradient_.with_outputs) {
      for (const at::Tensor& y : outputs) results.push_back(y.detach());
    }
    for (size_t j = 0; j < wrt.size(); ++j) {
      at::Tensor g = grads[j].defined() ? grads[j] : torch::zeros_like(wrt[j]);
      // A replicated input's cotangent is the sum of its replicas' parts.
      const std::string axes = ReplicatedAxes(gradient_.in_specs[static_cast<size_t>(gradient_.wrt[j])]);
      if (!axes.empty() && GroupSize(axes) > 1) g = AllReduceRaw(g.contiguous(), axes, "sum");
      results.push_back(g.detach());
    }
    return results;
  }

 protected:
  bool differentiates() const override { return true; }

 private:
  absl::Status Invalid(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("gradient '", name(), "' ", what));
  }
  // The mesh axes a value laid out by `spec` is replicated along: those no dimension names.
  // Outside a slice there are none.
  static std::string ReplicatedAxes(const std::vector<std::string>& spec) {
    collective::ShardCollectives* shard = collective::ShardCollectives::Current();
    if (shard == nullptr) return "";
    std::vector<std::string> replicated;
    for (const std::string& axis : shard->axis_names()) {
      bool splits = false;
      for (const std::string& d : spec) {
        for (absl::string_view a : absl::StrSplit(d, ',')) splits = splits || absl::StripAsciiWhitespace(a) == axis;
      }
      if (!splits) replicated.push_back(axis);
    }
    return absl::StrJoin(replicated, ",");
  }
  static int Replicas(const std::vector<std::string>& spec) {
    const std::string axes = ReplicatedAxes(spec);
    return axes.empty() ? 1 : GroupSize(axes);
  }

  const std::shared_ptr<const TorchExecutable> primal_;
  const FunctionBody::Gradient gradient_;
};

absl::StatusOr<std::shared_ptr<const TorchExecutable>> CompilePrimal(const FunctionBody& body) {
  if (body.kind == FunctionBody::Kind::kBuiltin) {
    const size_t at = body.name.find('@');
    const std::string kernel = body.name.substr(0, at);
    auto it = Builtins().find(kernel);
    if (it == Builtins().end()) {
      return absl::NotFoundError(absl::StrCat("unknown built-in kernel '", kernel,
                                              "'; known: ", absl::StrJoin(BuiltinKernelNames(), ", ")));
    }
    if (at != std::string::npos && !it->second.collective) {
      return absl::InvalidArgumentError(
          absl::StrCat("built-in kernel '", kernel, "' is not a collective and takes no mesh axes ('", body.name, "')"));
    }
    return std::make_shared<BuiltinExecutable>(body.name, it->second,
                                               at == std::string::npos ? "" : body.name.substr(at + 1));
  }
  auto unit = std::make_shared<torch::jit::CompilationUnit>();
  try {
    unit->define(c10::nullopt, body.source, std::make_shared<PathwaysResolver>(), nullptr);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("TorchScript function '", body.name,
                                                   "' failed to compile: ", e.what()));
  }
  torch::jit::Function* fn = unit->find_function(c10::QualifiedName(body.name));
  if (fn == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TorchScript source defines no function named '", body.name, "'"));
  }
  return std::make_shared<ScriptExecutable>(body.name, std::move(unit), fn);
}

absl::StatusOr<std::shared_ptr<const Executable>> CompileBody(const FunctionBody& body) {
  PW_RETURN_IF_ERROR(ValidateFunctionBody(body));
  FunctionBody primal_body = body;
  primal_body.gradient.reset();
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const TorchExecutable> primal, CompilePrimal(primal_body));
  if (!body.gradient) return primal;
  return std::make_shared<VjpExecutable>(absl::StrCat("vjp(", body.name, ")"), std::move(primal), *body.gradient);
}

}  // namespace

std::vector<std::string> BuiltinKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, kernel] : Builtins()) names.push_back(name);
  return names;
}

FunctionCache::FunctionCache() = default;

absl::StatusOr<std::shared_ptr<const Executable>> FunctionCache::Compile(const FunctionBody& body) {
  std::string key = FunctionKey(body);
  if (auto cached = Lookup(key)) return cached;
  // Compiled outside the lock: TorchScript compilation takes milliseconds. Two racing compiles
  // of one body both succeed and the first stored wins.
  auto compiled = CompileBody(body);
  if (!compiled.ok()) return compiled.status();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = cache_.emplace(key, *compiled);
  return it->second;
}

std::shared_ptr<const Executable> FunctionCache::Lookup(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  return it == cache_.end() ? nullptr : it->second;
}

size_t FunctionCache::size() const {
  absl::MutexLock lock(&mu_);
  return cache_.size();
}

namespace {

// libtorch's CPU allocations (kernel outputs and temporaries) through HostMemory: a large one
// reuses the pages of an earlier one of its size instead of faulting in fresh ones. On a device's
// stream they are charged to the device's budget, as an accelerator's kernels take their
// temporaries from its memory: activations a gradient keeps, results before they are copied into
// their output buffers. One that does not fit waits, as output buffers do, for others to be
// released (by clients, or by transfers to other devices), then fails the kernel
// (ResourceExhausted). A header in front of the data says
// what to release; the data pointer is its own context, so raw_allocate works too.
class CachingHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) const override {
    const std::shared_ptr<MemoryBudget>* budget = MemoryBudget::Current();
    if (budget != nullptr) {
      absl::Status charged = (*budget)->Charge(static_cast<int64_t>(bytes), (*budget)->kernel_wait());
      if (!charged.ok()) KernelMemoryFailure() = charged;
      TORCH_CHECK_WITH(OutOfMemoryError, charged.ok(), charged.message());
    }
    char* block = HostMemory::Allocate(bytes + kHeaderBytes);
    if (block == nullptr) {
      if (budget != nullptr) (*budget)->Release(static_cast<int64_t>(bytes));
      throw std::bad_alloc();
    }
    new (block) Header{budget != nullptr ? *budget : nullptr, static_cast<int64_t>(bytes)};
    char* data = block + kHeaderBytes;
    return {data, data, &Delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

 private:
  struct Header {
    std::shared_ptr<MemoryBudget> budget;
    int64_t bytes;
  };
  static constexpr size_t kHeaderBytes = 64;  // keeps the data 64-byte aligned
  static_assert(sizeof(Header) <= kHeaderBytes);
  static void Delete(void* data) {
    if (data == nullptr) return;
    char* block = static_cast<char*>(data) - kHeaderBytes;
    Header* header = reinterpret_cast<Header*>(block);
    if (header->budget != nullptr) header->budget->Release(header->bytes);
    header->~Header();
    HostMemory::Free(block);
  }
};

}  // namespace

void ConfigureComputeThreads(int intra_op_threads) {
  static std::once_flag allocator_installed;
  std::call_once(allocator_installed, [] {
    static CachingHostAllocator allocator;
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
  });
  at::set_num_threads(intra_op_threads);
  // OpenBLAS keeps its own pool; bound it too when the library is loaded.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(intra_op_threads);
  }
}

}  // namespace pathways
