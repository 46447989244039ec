// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include "compute/torch_executable.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/frontend/parser.h>
#include <torch/csrc/jit/frontend/resolver.h>
#include <torch/csrc/jit/frontend/sugared_value.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
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
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("function '", name_, "' ran out of host memory"));
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

// Public ops of libtorch 1.13 that a sweep of hostile arguments (2026-12-07) found writing,
// reading or crashing out of bounds on CPU: as_strided* (an offset near 2^62 overflows the bounds
// check), linalg_ldl_solve and lu_unpack (pivots), batch_norm_update_stats and rrelu_with_noise
// (short running stats or noise), fractional_max_pool* (samples), ctc_loss (labels), the linear
// upsamplers (tiny scales), slow_conv* (a kernel size that is not the weight's), multi_margin_loss
// (a short weight), pixel_shuffle (an overflowing factor), grid_sampler* (a mode out of range
// returns memory never written); and set_ (a storage at any offset) and segment_reduce (an `unsafe`
// flag). searchsorted is refused only with a `sorter` (CheckOps).
bool UncheckedPublic(const std::string& op) {
  static const auto* ops = new absl::flat_hash_set<std::string>{"linalg_ldl_solve",
                                                                "lu_unpack",
                                                                "batch_norm_update_stats",
                                                                "rrelu_with_noise",
                                                                "ctc_loss",
                                                                "upsample_linear1d",
                                                                "upsample_bilinear2d",
                                                                "upsample_trilinear3d",
                                                                "multi_margin_loss",
                                                                "pixel_shuffle",
                                                                "set_",
                                                                "segment_reduce"};
  return ops->contains(op);
}

// Why a tenant's function may not call op `kind`; empty when it may. Functions run inside a worker
// that other tenants share, and the TorchScript interpreter is no sandbox: many of libtorch's
// internal ops index, view or build storage without checking what they are given (the backward
// kernels, `native_` and `_`-prefixed helpers: an index of 2^40 into
// max_pool2d_with_indices_backward or _cummax_helper writes wherever it points), and a few open
// files. Those would let one tenant write over the worker's memory or read the host's files, so a
// function may call only the public forward ops (aten's names without a leading `_`, besides the
// `__dunder__` operators and `_set_item`, which the compiler emits for `l[i] = v`) less the
// kinds below and UncheckedPublic's, prim's control flow, and the pathways ops. Gradients are autograd's, not the
// body's. (Source reaches aten ops as `torch.*` and ours as `pathways.*` only; ops of other namespaces are refused
// should that change.)
std::string RefusedOp(c10::Symbol kind) {
  const std::string ns = kind.ns().toUnqualString();
  const std::string op = kind.toUnqualString();
  constexpr char kUnchecked[] = "it can reach memory outside its tensors (unchecked indices or sizes)";
  if (ns == "pathways") return "";
  if (ns == "prim") {
    if (absl::StrContains(op, "rpc")) return "it calls other processes";
    if (op == "Print") return "it writes to the worker's log; a function's output is what it returns";
    return "";
  }
  if (ns != "aten") return "a function may call aten, prim and pathways ops only";
  if (op == "from_file" || op == "save") return "it reads or writes files on the worker's host";
  if (op == "manual_seed" || op == "seed") {
    return "it reseeds the generator every tenant of the worker shares (pathways.uniform and pathways.normal are "
           "counter-based, the caller's own)";
  }
  if (op == "unsafe_split" || op == "unsafe_chunk" || op == "unsafe_split_with_sizes" || op == "_set_item") return "";
  if ((absl::StartsWith(op, "_") && !absl::StartsWith(op, "__")) || absl::StartsWith(op, "native_") ||
      absl::StrContains(op, "backward") || absl::StrContains(op, "unsafe") || absl::StrContains(op, "sparse") ||
      absl::StrContains(op, "nested") || absl::StartsWith(op, "slow_conv") || absl::StartsWith(op, "as_strided") ||
      absl::StartsWith(op, "fractional_max_pool") || absl::StartsWith(op, "grid_sampler") || UncheckedPublic(op)) {
    return kUnchecked;
  }
  return "";
}

// Refuses a function whose source calls an op RefusedOp names, in any function it defines (what
// those call of torch's own is torch's and is not looked into).
absl::Status CheckOps(const torch::jit::CompilationUnit& unit, const std::string& name) {
  std::function<absl::Status(const torch::jit::Block&)> check = [&](const torch::jit::Block& block) -> absl::Status {
    for (const torch::jit::Node* node : block.nodes()) {
      std::string why = RefusedOp(node->kind());
      if (why.empty() && node->kind() == c10::Symbol::fromQualString("aten::searchsorted")) {
        // A `sorter` is not checked against the sequence: its indices are followed as they are.
        const c10::FunctionSchema* schema = node->maybeSchema();
        const auto sorter = schema != nullptr ? schema->argumentIndexWithName("sorter") : c10::nullopt;
        if (sorter.has_value() && *sorter < node->inputs().size() && !node->input(*sorter)->mustBeNone()) {
          why = "with a sorter it can reach memory outside its tensors (the sorter's indices are not checked)";
        }
      }
      if (!why.empty()) {
        std::string where;
        if (auto at = node->sourceRange().file_line_col()) {
          where = absl::StrCat(" (", std::get<0>(*at), ":", std::get<1>(*at), ")");
        }
        return absl::InvalidArgumentError(absl::StrCat("function '", name, "' calls ", node->kind().toQualString(),
                                                       where, ", which a function may not call: ", why));
      }
      for (const torch::jit::Block* inner : node->blocks()) PW_RETURN_IF_ERROR(check(*inner));
    }
    return absl::OkStatus();
  };
  for (torch::jit::Function* fn : unit.get_functions()) {
    PW_RETURN_IF_ERROR(check(*torch::jit::toGraphFunction(*fn).graph()->block()));
  }
  return absl::OkStatus();
}

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
    return absl::InvalidArgumentError(absl::StrCat("TorchScript function '", body.name,
                                                   "' failed to compile: ", e.what()));
  }
  torch::jit::Function* fn = unit->find_function(c10::QualifiedName(body.name));
  if (fn == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("TorchScript source defines no function named '", body.name, "'"));
  }
  PW_RETURN_IF_ERROR(CheckOps(*unit, body.name));
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
  return MakeVjpExecutable(body.DisplayName(), std::move(primal), *body.gradient, FunctionKey(forward));
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
