// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>
#include <torch/torch.h>

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

at::Tensor View(const DeviceBuffer& buffer) {
  return torch::from_blob(const_cast<char*>(buffer.data()), buffer.shape(),
                          torch::TensorOptions().dtype(*ToTorch(buffer.dtype())));
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
    OpFailure() = absl::OkStatus();
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
    // A replicated input's cotangent is the sum of its replicas' parts. Cotangents summed over the
    // same axes go in one all_reduce, concatenated (gradient bucketing, as DDP does): each
    // collective pays its latency per round, tens of microseconds over a data-centre link, and a
    // model's parameters are tens of arrays. The buckets are in the same order on every shard.
    std::map<std::pair<std::string, c10::ScalarType>, std::vector<size_t>> buckets;
    for (size_t j = 0; j < wrt.size(); ++j) {
      if (!grads[j].defined()) grads[j] = torch::zeros_like(wrt[j]);
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
    for (const at::Tensor& g : grads) results.push_back(g.detach());
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
    return axes.empty() ? 1 : ShardGroupSize(axes);
  }

  const std::shared_ptr<const TorchExecutable> primal_;
  const FunctionBody::Gradient gradient_;
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
  return std::make_shared<VjpExecutable>(absl::StrCat("vjp(", body.name, ")"), std::move(primal), *body.gradient);
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
