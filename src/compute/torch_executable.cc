// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "collective/collective.h"
#include "compute/executable.h"
#include "compute/torch_ops.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

// Whether `t`'s storage and `buffer` overlap.
bool SharesMemory(const at::Tensor& t, const DeviceBuffer& buffer) {
  if (!t.defined() || !t.has_storage()) return false;
  const char* begin = static_cast<const char*>(t.storage().data());
  const char* end = begin + t.storage().nbytes();
  return begin < buffer.data() + buffer.byte_size() && buffer.data() < end;
}

// A tensor over the buffer's bytes. One that `keeps` the buffer holds a reference to it, for as
// long as anything (an autograd graph kept after the call) holds the tensor's storage.
at::Tensor View(const DeviceBuffer& buffer, bool keeps) {
  char* data = const_cast<char*>(buffer.data());
  const auto options = torch::TensorOptions().dtype(*ToTorch(buffer.dtype()));
  if (!keeps) return torch::from_blob(data, buffer.shape(), options);
  std::shared_ptr<const DeviceBuffer> owner = buffer.weak_from_this().lock();
  TORCH_CHECK(owner != nullptr, "a kept view needs a buffer owned by a BufferPtr");
  return torch::from_blob(data, buffer.shape(), [owner = std::move(owner)](void*) {}, options);
}

// The device buffers a body runs on, for bodies that read or set what they carry besides bytes.
struct Buffers {
  absl::Span<const DeviceBuffer* const> inputs;
  absl::Span<DeviceBuffer* const> outputs;
};

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
    OpFailure() = absl::OkStatus();
    try {
      // Bodies run without autograd's bookkeeping, except those that differentiate: their
      // inputs must not be inference tensors, which autograd cannot record.
      c10::optional<c10::InferenceMode> inference;
      if (!differentiates()) inference.emplace();
      // A kept graph views its inputs: one that is also an output (donated in place) would be
      // written over under it, and a handle's graph holding its own buffer would never be freed.
      if (keeps_input_views()) {
        for (const DeviceBuffer* out : outputs) {
          if (std::find(inputs.begin(), inputs.end(), out) != inputs.end()) {
            return absl::InvalidArgumentError(absl::StrCat("function '", name_, "' keeps residuals, which view its ",
                                                           "inputs: it cannot take a donated input's buffer"));
          }
        }
      }
      std::vector<at::Tensor> args;
      args.reserve(inputs.size());
      for (const DeviceBuffer* b : inputs) args.push_back(View(*b, keeps_input_views()));
      auto r = Invoke(args, {inputs, outputs});
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
      if (!OpFailure().ok()) {
        absl::Status failed = std::exchange(OpFailure(), absl::OkStatus());
        return absl::Status(failed.code(), absl::StrCat("function '", name_, "' failed: ", failed.message()));
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
  virtual absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args,
                                                         const Buffers& buffers) const = 0;

 protected:
  virtual bool differentiates() const { return false; }
  // Whether the views of the inputs keep their buffers alive (they may outlive the call).
  virtual bool keeps_input_views() const { return false; }

 private:
  std::string name_;
};

class BuiltinExecutable : public TorchExecutable {
 public:
  BuiltinExecutable(std::string name, const BuiltinKernel& kernel, std::string axes)
      : TorchExecutable(std::move(name)), kernel_(kernel), axes_(std::move(axes)) {}

 public:
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args, const Buffers&) const override {
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
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args, const Buffers&) const override {
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


// What a backward pass needs of a forward one: where each output's cotangent enters the autograd
// graph and where each differentiated input's gradient leaves it, with their shapes. It holds the
// graph's nodes (and so what they saved), not the outputs' storage.
struct AutogradGraph {
  struct End {
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
    torch::autograd::Edge edge;  // without a function: not in the graph
  };
  std::vector<End> outputs, wrt;

  static AutogradGraph Of(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& wrt) {
    AutogradGraph g;
    for (const at::Tensor& y : outputs) {
      g.outputs.push_back({y.sizes().vec(), y.scalar_type(),
                           y.requires_grad() ? torch::autograd::impl::gradient_edge(y) : torch::autograd::Edge()});
    }
    for (const at::Tensor& x : wrt) {  // leaves: their gradient arrives at their accumulator, if used
      std::shared_ptr<torch::autograd::Node> fn = x.grad_fn();
      if (fn == nullptr) fn = torch::autograd::impl::try_get_grad_accumulator(x);
      g.wrt.push_back({x.sizes().vec(), x.scalar_type(),
                       fn != nullptr ? torch::autograd::Edge(std::move(fn), x.output_nr()) : torch::autograd::Edge()});
    }
    return g;
  }
};

// What a forward pass that keeps its residuals leaves with its handle's buffer: the autograd
// graph from the inputs it differentiates to its outputs. The graph's saved tensors are
// libtorch's allocations, charged to the device that ran the pass, and views of input buffers,
// which they keep alive (so a later call that is donated one of them copies it instead).
struct KeptResiduals final : public BufferAttachment {
  std::string forward_key;          // FunctionKey of the forward body that made them
  // The gang it ran in and this shard's place in it (null outside one): the graph's collectives
  // go over its groups, so the backward pass runs only in the same gang.
  std::shared_ptr<const collective::GangLayout> gang;
  int64_t shard = -1;
  AutogradGraph graph;
  mutable absl::Mutex mu;  // one backward pass through the graph at a time
};

// The vector-Jacobian product of a primal body (FunctionBody::Gradient), whole or in halves.
// Whole, the forward pass runs again here under autograd: a residual would be one more output
// per intermediate, held on the device between the forward and the backward call (for every
// microbatch in flight, in a pipeline); recomputing costs one more forward pass (GPipe
// rematerialises the same way). Split, the forward half keeps the graph with its residual handle
// and the backward half runs it: one forward pass less, for the memory of the residuals. Random
// ops draw from counters, so a recomputed pass sees the same numbers as the original one.
class VjpExecutable : public TorchExecutable {
 public:
  VjpExecutable(std::string name, std::shared_ptr<const TorchExecutable> primal, FunctionBody::Gradient gradient,
                std::string forward_key)
      : TorchExecutable(std::move(name)),
        primal_(std::move(primal)),
        gradient_(std::move(gradient)),
        forward_key_(std::move(forward_key)) {}

  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args, const Buffers& buffers) const override {
    switch (gradient_.residuals) {
      case FunctionBody::Residuals::kKeep:
        return ForwardKeepingResiduals(args, buffers);
      case FunctionBody::Residuals::kUse:
        return BackwardFromResiduals(args, buffers);
      default:
        return Recompute(args);
    }
  }

 protected:
  bool differentiates() const override { return true; }
  bool keeps_input_views() const override { return gradient_.residuals == FunctionBody::Residuals::kKeep; }

 private:
  struct Forward {
    std::vector<at::Tensor> outputs;
    std::vector<at::Tensor> wrt;
  };

  absl::StatusOr<std::vector<at::Tensor>> Recompute(std::vector<at::Tensor>& args) const {
    const size_t num_inputs = gradient_.in_specs.size();
    if (args.size() < num_inputs) return Invalid(absl::StrCat("takes at least ", num_inputs, " inputs, got ", args.size()));
    std::vector<at::Tensor> primal_args(args.begin(), args.begin() + static_cast<std::ptrdiff_t>(num_inputs));
    PW_ASSIGN_OR_RETURN(Forward forward, RunForward(primal_args));
    PW_ASSIGN_OR_RETURN(std::vector<at::Tensor> grads,
                        Backward(AutogradGraph::Of(forward.outputs, forward.wrt),
                                 absl::MakeConstSpan(args).subspan(num_inputs), /*retain=*/false));
    std::vector<at::Tensor> results;
    if (gradient_.with_outputs) {
      for (const at::Tensor& y : forward.outputs) results.push_back(y.detach());
    }
    results.insert(results.end(), grads.begin(), grads.end());
    return results;
  }

  absl::StatusOr<std::vector<at::Tensor>> ForwardKeepingResiduals(std::vector<at::Tensor>& args,
                                                                  const Buffers& buffers) const {
    if (args.size() != gradient_.in_specs.size()) {
      return Invalid(absl::StrCat("takes ", gradient_.in_specs.size(), " inputs, got ", args.size()));
    }
    if (buffers.outputs.size() != gradient_.out_specs.size() + 1) {
      return Invalid(absl::StrCat("returns ", gradient_.out_specs.size() + 1,
                                  " values (the outputs and a residual handle), its signature has ",
                                  buffers.outputs.size()));
    }
    auto kept = std::make_shared<KeptResiduals>();
    kept->forward_key = forward_key_;
    if (const collective::ShardCollectives* shard = collective::ShardCollectives::Current()) {
      kept->gang = shard->layout();
      kept->shard = shard->shard();
    }
    int64_t kept_bytes = 0;
    std::vector<at::Tensor> results;
    {
      AllocationScope scope;
      PW_ASSIGN_OR_RETURN(Forward forward, RunForward(args));
      kept->graph = AutogradGraph::Of(forward.outputs, forward.wrt);
      // What stays is what the pass allocated and holds, less the outputs' storage that only the
      // outputs hold (freed once they are copied out). Provably only theirs: no tensor but the
      // outputs on the storage, and no reference to them but the outputs' own (the graph saves a
      // tensor that another op read as that tensor itself). A view output holds its base too, so
      // its storage is counted: the value may be above what stays, never below.
      kept_bytes = scope.live_bytes();
      std::map<const c10::StorageImpl*, std::map<const c10::TensorImpl*, size_t>> holders;
      for (const at::Tensor& y : forward.outputs) ++holders[y.storage().unsafeGetStorageImpl()][y.unsafeGetTensorImpl()];
      for (const at::Tensor& y : forward.outputs) {
        const auto& tensors = holders[y.storage().unsafeGetStorageImpl()];
        if (tensors.empty()) continue;  // counted already
        bool only_outputs = y.storage().use_count() == tensors.size();
        for (const at::Tensor& z : forward.outputs) {
          auto it = tensors.find(z.unsafeGetTensorImpl());
          if (it != tensors.end() && z.use_count() != it->second) only_outputs = false;
        }
        if (only_outputs) kept_bytes -= scope.BytesOf(y.storage());
        holders[y.storage().unsafeGetStorageImpl()].clear();
      }
      for (const at::Tensor& y : forward.outputs) results.push_back(y.detach());
    }
    results.push_back(torch::full({}, kept_bytes, torch::kInt64));
    buffers.outputs.back()->set_attachment(std::move(kept));
    return results;
  }

  absl::StatusOr<std::vector<at::Tensor>> BackwardFromResiduals(std::vector<at::Tensor>& args,
                                                                const Buffers& buffers) const {
    if (args.empty()) return Invalid("takes a residual handle first, got no inputs");
    const auto* kept = dynamic_cast<const KeptResiduals*>(buffers.inputs[0]->attachment().get());
    if (kept == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "gradient '", name(), "' input 0 carries no residuals on this device: a residual handle holds them only on "
          "the devices of the forward call that made it (call both halves on one slice; a handle moved elsewhere or "
          "put from the client has none)"));
    }
    if (kept->forward_key != forward_key_) {
      return Invalid("input 0 holds the residuals of another function's forward pass");
    }
    // Every member of a gang that differs fails here alike, before any collective.
    const collective::ShardCollectives* shard = collective::ShardCollectives::Current();
    const bool same_gang = shard == nullptr ? kept->gang == nullptr
                                            : kept->gang != nullptr && *kept->gang == *shard->layout() &&
                                                  kept->shard == shard->shard();
    if (!same_gang) {
      return absl::FailedPreconditionError(absl::StrCat(
          "gradient '", name(), "' input 0 holds residuals of a forward call on another slice or mesh: the backward ",
          "half runs only on the slice (the same devices in the same mesh) of the forward call that made them"));
    }
    absl::MutexLock lock(&kept->mu);
    return Backward(kept->graph, absl::MakeConstSpan(args).subspan(1), /*retain=*/true);
  }

  // The primal's outputs on `primal_args`, recorded by autograd from the inputs in `wrt`.
  absl::StatusOr<Forward> RunForward(std::vector<at::Tensor>& primal_args) const {
    Forward forward;
    for (int i : gradient_.wrt) {
      at::Tensor& x = primal_args[static_cast<size_t>(i)];
      if (!at::isFloatingType(x.scalar_type())) {
        return Invalid(absl::StrCat("input ", i, " is not floating point and has no gradient"));
      }
      x = x.detach().requires_grad_(true);
      forward.wrt.push_back(x);
    }
    {
      at::AutoGradMode grad(true);
      PW_ASSIGN_OR_RETURN(forward.outputs, primal_->Invoke(primal_args, {}));
    }
    if (forward.outputs.size() != gradient_.out_specs.size()) {
      return Invalid(absl::StrCat("its primal returned ", forward.outputs.size(), " values, its signature has ",
                                  gradient_.out_specs.size(), " outputs"));
    }
    return forward;
  }

  // The cotangents of `forward.wrt`, from one cotangent per floating-point output. `retain` keeps
  // the graph for another pass.
  absl::StatusOr<std::vector<at::Tensor>> Backward(const AutogradGraph& graph,
                                                   absl::Span<const at::Tensor> cotangents, bool retain) const {
    const std::vector<AutogradGraph::End>& outputs = graph.outputs;
    // One cotangent per floating-point output, each shared among the output's replicas.
    torch::autograd::edge_list roots, ends;
    std::vector<at::Tensor> seeds;
    size_t next = 0;
    for (size_t k = 0; k < outputs.size(); ++k) {
      if (!at::isFloatingType(outputs[k].dtype)) continue;
      if (next >= cotangents.size()) return Invalid(absl::StrCat("has no cotangent for output ", k));
      const at::Tensor& cotangent = cotangents[next++];
      if (cotangent.sizes() != c10::IntArrayRef(outputs[k].sizes) || cotangent.scalar_type() != outputs[k].dtype) {
        return Invalid(absl::StrCat("the cotangent of output ", k, " is ", c10::toString(cotangent.scalar_type()),
                                    c10::str(cotangent.sizes()), " but the output is ",
                                    c10::toString(outputs[k].dtype), c10::str(c10::IntArrayRef(outputs[k].sizes))));
      }
      if (!outputs[k].edge.is_valid()) continue;  // does not depend on what is differentiated
      roots.push_back(outputs[k].edge);
      const int replicas = Replicas(gradient_.out_specs[k]);
      seeds.push_back(replicas == 1 ? cotangent : cotangent / replicas);
    }
    if (next != cotangents.size()) {
      return Invalid(absl::StrCat("takes one cotangent per floating-point output of its primal (", next, "), got ",
                                  cotangents.size()));
    }
    // As torch::autograd::grad does, from the graph's ends rather than the tensors: the gradients
    // arriving at each differentiated input's end, none where nothing reaches it.
    std::vector<size_t> reached;
    for (size_t j = 0; j < graph.wrt.size(); ++j) {
      if (!graph.wrt[j].edge.is_valid()) continue;
      ends.push_back(graph.wrt[j].edge);
      reached.push_back(j);
    }
    std::vector<at::Tensor> grads(graph.wrt.size());
    if (!roots.empty() && !ends.empty()) {
      std::vector<at::Tensor> got = torch::autograd::Engine::get_default_engine().execute(
          roots, seeds, /*keep_graph=*/retain, /*create_graph=*/false, /*accumulate_grad=*/false, ends);
      for (size_t e = 0; e < reached.size(); ++e) grads[reached[e]] = std::move(got[e]);
    }
    // A replicated input's cotangent is the sum of its replicas' parts. Cotangents summed over the
    // same axes go in one all_reduce, concatenated (gradient bucketing, as DDP does): each
    // collective pays its latency per round, tens of microseconds over a data-centre link, and a
    // model's parameters are tens of arrays. The buckets are in the same order on every shard.
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<size_t>> buckets;
    for (size_t j = 0; j < grads.size(); ++j) {
      const AutogradGraph::End& x = graph.wrt[j];
      if (!grads[j].defined()) grads[j] = torch::zeros(x.sizes, torch::TensorOptions().dtype(x.dtype));
      const std::string axes = ReplicatedAxes(gradient_.in_specs[static_cast<size_t>(gradient_.wrt[j])]);
      if (!axes.empty() && ShardGroupSize(axes) > 1) buckets[{axes, grads[j].scalar_type()}].push_back(j);
    }
    for (const auto& [key, members] : buckets) {
      if (members.size() == 1) {
        grads[members[0]] = AllReduceNoGrad(grads[members[0]].contiguous(), key.first, "sum");
        continue;
      }
      std::vector<at::Tensor> flat;
      for (size_t j : members) flat.push_back(grads[j].reshape({-1}));
      const at::Tensor summed = AllReduceNoGrad(torch::cat(flat), key.first, "sum");
      int64_t offset = 0;
      for (size_t j : members) {
        const int64_t n = grads[j].numel();
        grads[j] = summed.narrow(0, offset, n).view(grads[j].sizes());
        offset += n;
      }
    }
    for (at::Tensor& g : grads) g = g.detach();
    return grads;
  }

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
    return axes.empty() ? 1 : ShardGroupSize(axes);
  }

  const std::shared_ptr<const TorchExecutable> primal_;
  const FunctionBody::Gradient gradient_;
  const std::string forward_key_;  // of the forward half of this product, split
};

absl::StatusOr<std::shared_ptr<const TorchExecutable>> CompilePrimal(const FunctionBody& body) {
  if (body.kind == FunctionBody::Kind::kBuiltin) {
    const size_t at = body.name.find('@');
    const std::string kernel = body.name.substr(0, at);
    auto it = BuiltinKernels().find(kernel);
    if (it == BuiltinKernels().end()) {
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

}  // namespace

absl::StatusOr<std::shared_ptr<const Executable>> CompileForCpu(const FunctionBody& body) {
  PW_RETURN_IF_ERROR(ValidateFunctionBody(body));
  FunctionBody primal_body = body;
  primal_body.gradient.reset();
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const TorchExecutable> primal, CompilePrimal(primal_body));
  if (!body.gradient) return primal;
  FunctionBody forward = body;
  forward.gradient->residuals = FunctionBody::Residuals::kKeep;
  return std::make_shared<VjpExecutable>(body.DisplayName(), std::move(primal), *body.gradient,
                                         FunctionKey(forward));
}

std::vector<std::string> BuiltinKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, kernel] : BuiltinKernels()) names.push_back(name);
  return names;
}

FunctionCache::FunctionCache(Compiler compiler) : compiler_(std::move(compiler)) {}

absl::StatusOr<std::shared_ptr<const Executable>> FunctionCache::Compile(const FunctionBody& body) {
  std::string key = FunctionKey(body);
  if (auto cached = Lookup(key)) return cached;
  // Compiled outside the lock: TorchScript compilation takes milliseconds. Two racing compiles
  // of one body both succeed and the first stored wins.
  auto compiled = compiler_(body);
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

}  // namespace pathways
