// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include "compute/torch_executable.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/frontend/parser.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collective/collective.h"
#include "compute/body_heap.h"
#include "compute/executable.h"
#include "compute/op_guards.h"
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

}  // namespace

absl::Status TorchExecutable::Run(absl::Span<const DeviceBuffer* const> inputs,
                                  absl::Span<DeviceBuffer* const> outputs) const {
  std::vector<at::Tensor> results;
  KernelMemoryFailure() = absl::OkStatus();
  OpFailure() = absl::OkStatus();
  // The body's lists and strings are charged to the device running it, as its tensors are.
  const std::shared_ptr<MemoryBudget>* budget = MemoryBudget::Current();
  ScopedBodyHeap heap(budget != nullptr ? *budget : nullptr);
  auto out_of_memory = [&](absl::string_view why) {
    return absl::ResourceExhaustedError(absl::StrCat("function '", name_, "' ran out of device memory: ", why));
  };
  try {
    // Bodies run without autograd's bookkeeping, except those that differentiate: their
    // inputs must not be inference tensors, which autograd cannot record.
    c10::optional<c10::InferenceMode> inference;
    if (!differentiates()) inference.emplace();
    // Whatever the body does with grad mode (torch.set_grad_enabled) ends with it: the device
    // thread runs the next body, another tenant's perhaps, as it was.
    const at::AutoGradMode grad_mode(at::GradMode::is_enabled());
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
    // A small malloc past the budget is let through, not refused (body_malloc.cc): the body may
    // have ended before a loop's turn stopped it.
    if (!heap.failure().ok()) return out_of_memory(heap.failure().message());
    results = std::move(*r);
    if (results.size() != outputs.size()) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name_, "' returned ",
                                                     results.size(), " values, its signature has ",
                                                     outputs.size(), " outputs"));
    }
    // Results are copied out of their memory: a tensor with none behind it (of the meta device,
    // whose data pointer is any number a body likes) would be read from wherever it points.
    for (size_t i = 0; i < results.size(); ++i) {
      if (!results[i].device().is_cpu() || !results[i].has_storage()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name_, "' output ", i, " is on device ",
                                                       results[i].device().str(), ", not in the device's memory"));
      }
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
  } catch (const std::bad_alloc&) {
    const BodyHeapPause runtime;  // the error's words are the runtime's: a refused heap may not refuse them
    if (!heap.failure().ok()) return out_of_memory(heap.failure().message());
    return absl::ResourceExhaustedError(absl::StrCat("function '", name_, "' ran out of host memory"));
  } catch (const std::exception& e) {
    const BodyHeapPause runtime;
    // The TorchScript interpreter rethrows what a kernel threw as its own error: a refused
    // allocation is known by what the allocator (or the body's heap) recorded.
    if (!KernelMemoryFailure().ok()) {
      absl::Status refused = std::exchange(KernelMemoryFailure(), absl::OkStatus());
      return out_of_memory(refused.message());
    }
    if (!heap.failure().ok()) return out_of_memory(heap.failure().message());
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
    // The body raised: an error of the user's function or of what it was given (a dtype it did
    // not expect, an index out of range, shapes a built-in kernel cannot combine), as a Python
    // function's exception would be. Kernels are pure functions of their inputs, so this is
    // taken to be the caller's, not the runtime's.
    return absl::InvalidArgumentError(absl::StrCat("function '", name_, "' failed at run time: ", e.what()));
  }
  return absl::OkStatus();
}

namespace {

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
  ScriptExecutable(std::string name, std::shared_ptr<torch::jit::CompilationUnit> unit, torch::jit::Function* function,
                   bool optimise, int64_t held_bytes)
      : TorchExecutable(std::move(name)),
        unit_(std::move(unit)),
        function_(function),
        optimise_(optimise),
        held_bytes_(held_bytes) {}
  int64_t held_bytes() const override { return held_bytes_; }

 public:
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args, const Buffers&) const override {
    std::vector<c10::IValue> stack(args.begin(), args.end());
    // A tenant's body runs as written, without the graph executor's optimising passes, unless the
    // worker trusts its tenants (FunctionOps::kPublic). At a body's first runs those passes fold its
    // constants (lists, strings) into the executable, where they stay past the run, uncharged, for
    // as long as it is cached (a list of 10^7 held 160 MB), and compare or hash them there, where
    // no stop request reaches and no op's check applies (`[s] * 10**6` twice, then `==`, held a
    // device for 112 s). libtorch fuses no CPU kernels, so they bring little else here. The unit
    // runs only from here: a call under the thread's default setting would fix its optimised plan.
    const torch::jit::GraphOptimizerEnabledGuard passes(optimise_);
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
  const bool optimise_;
  const int64_t held_bytes_;
};

// What compiling one body may hold past the heap's allowance, and so what its compiled function may
// keep (see CompilePrimal). Functions keep 0.1-0.5 MiB (a model's loss and optimizer, measured).
constexpr int64_t kCompileMemory = int64_t{64} << 20;

absl::StatusOr<std::shared_ptr<const TorchExecutable>> CompilePrimal(const FunctionBody& body, FunctionOps ops) {
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
  // Compiling folds constants (define's passes run string and number ops on them): a body that
  // doubles a constant string 34 times would build 32 GiB here, on every worker, before any device
  // is involved. What the compile holds past the heap's allowance is charged to a budget of its own;
  // a fold refused is left for the run, where the device's budget refuses it. What the function
  // keeps (the heap's count at the end: its graph and folded constants) stays for as long as the
  // worker caches it, which bounds what all of them keep (FunctionCache).
  ScopedBodyHeap heap(std::make_shared<MemoryBudget>("the compiler", kCompileMemory));
  try {
    // Parsed here rather than by define(source), which names every source "<string>": errors and
    // tracebacks then point at the user's file and line.
    torch::jit::Parser parser(std::make_shared<torch::jit::Source>(
        body.source, body.source_file.empty() ? "<string>" : body.source_file, 1));
    std::vector<torch::jit::Def> definitions;
    std::vector<torch::jit::ResolverPtr> resolvers;
    const auto resolver = std::make_shared<PathwaysResolver>();
    while (parser.lexer().cur().kind != torch::jit::TK_EOF) {
      definitions.emplace_back(parser.parseFunction(/*is_method=*/false));
      resolvers.push_back(resolver);
    }
    unit->define(c10::nullopt, {}, {}, definitions, resolvers, nullptr);
  } catch (const std::exception& e) {
    const BodyHeapPause runtime;  // the error's words are the runtime's: a refused heap may not refuse them
    if (!heap.failure().ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("TorchScript function '", body.name,
                       "' failed to compile: compiling folds what its source builds from literals (strings, numbers) "
                       "into constants, and this took more than a compile may hold (build such values from an input, "
                       "at run time): ",
                       heap.failure().message()));
    }
    return absl::InvalidArgumentError(absl::StrCat("TorchScript function '", body.name,
                                                   "' failed to compile: ", e.what()));
  }
  // What follows is the runtime's (the checks, their stop points, the executable), and is not
  // refused even where a fold was.
  const int64_t kept = heap.live_bytes();
  const BodyHeapPause runtime;
  torch::jit::Function* fn = unit->find_function(c10::QualifiedName(body.name));
  if (fn == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TorchScript source defines no function named '", body.name, "'"));
  }
  try {
    PW_RETURN_IF_ERROR(ConfineBody(*unit, body.name, ops));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("function '", body.name, "' could not be checked: ", e.what()));
  }
  return std::make_shared<ScriptExecutable>(body.name, std::move(unit), fn, ops == FunctionOps::kPublic, kept);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Executable>> CompileForCpu(const FunctionBody& body, FunctionOps ops) {
  PW_RETURN_IF_ERROR(ValidateFunctionBody(body));
  FunctionBody primal_body = body;
  primal_body.gradient.reset();
  PW_ASSIGN_OR_RETURN(std::shared_ptr<const TorchExecutable> primal, CompilePrimal(primal_body, ops));
  if (!body.gradient) return primal;
  FunctionBody forward = body;
  forward.gradient->residuals = FunctionBody::Residuals::kKeep;
  return MakeVjpExecutable(body.DisplayName(), std::move(primal), *body.gradient, FunctionKey(forward));
}

std::vector<std::string> BuiltinKernelNames() {
  std::vector<std::string> names;
  for (const auto& [name, kernel] : BuiltinKernels()) names.push_back(name);
  return names;
}

}  // namespace pathways
