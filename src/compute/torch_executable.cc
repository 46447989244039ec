// The one place that turns DeviceBuffers into torch tensors. Buffers are viewed, not copied.
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <dlfcn.h>

#include <functional>
#include <map>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "compute/executable.h"

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

at::Tensor View(const DeviceBuffer& buffer) {
  return torch::from_blob(const_cast<char*>(buffer.data()), buffer.shape(),
                          torch::TensorOptions().dtype(*ToTorch(buffer.dtype())));
}

using Kernel = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct BuiltinKernel {
  int arity;
  Kernel fn;
};

const std::map<std::string, BuiltinKernel>& Builtins() {
  using V = std::vector<at::Tensor>;
  static const auto* kernels = new std::map<std::string, BuiltinKernel>{
      {"identity", {1, [](const V& x) { return V{x[0].clone()}; }}},
      {"add_one", {1, [](const V& x) { return V{x[0] + 1}; }}},
      {"negate", {1, [](const V& x) { return V{-x[0]}; }}},
      {"relu", {1, [](const V& x) { return V{torch::relu(x[0])}; }}},
      {"tanh", {1, [](const V& x) { return V{torch::tanh(x[0])}; }}},
      {"add", {2, [](const V& x) { return V{x[0] + x[1]}; }}},
      {"multiply", {2, [](const V& x) { return V{x[0] * x[1]}; }}},
      {"matmul", {2, [](const V& x) { return V{torch::matmul(x[0], x[1])}; }}},
      {"sum", {1, [](const V& x) { return V{x[0].sum()}; }}},
  };
  return *kernels;
}

// Runs the body-specific part; the common part (viewing, checking, copying out) is shared.
class TorchExecutable : public Executable {
 public:
  explicit TorchExecutable(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }

  absl::Status Run(absl::Span<const DeviceBuffer* const> inputs,
                   absl::Span<DeviceBuffer* const> outputs) const override {
    std::vector<at::Tensor> results;
    try {
      c10::InferenceMode inference;
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
        std::memcpy(out.data(), t.data_ptr(), static_cast<size_t>(out.byte_size()));
      }
    } catch (const std::exception& e) {
      return absl::InternalError(
          absl::StrCat("function '", name_, "' failed at run time: ", e.what()));
    }
    return absl::OkStatus();
  }

 protected:
  virtual absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const = 0;

 private:
  std::string name_;
};

class BuiltinExecutable : public TorchExecutable {
 public:
  BuiltinExecutable(std::string name, const BuiltinKernel& kernel)
      : TorchExecutable(std::move(name)), kernel_(kernel) {}

 protected:
  absl::StatusOr<std::vector<at::Tensor>> Invoke(std::vector<at::Tensor>& args) const override {
    if (static_cast<int>(args.size()) != kernel_.arity) {
      return absl::InvalidArgumentError(absl::StrCat("built-in kernel '", name(), "' takes ",
                                                     kernel_.arity, " inputs, got ", args.size()));
    }
    return kernel_.fn(args);
  }

 private:
  const BuiltinKernel& kernel_;
};

class ScriptExecutable : public TorchExecutable {
 public:
  ScriptExecutable(std::string name, std::shared_ptr<torch::jit::CompilationUnit> unit,
                   torch::jit::Function* function)
      : TorchExecutable(std::move(name)), unit_(std::move(unit)), function_(function) {}

 protected:
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

absl::StatusOr<std::shared_ptr<const Executable>> CompileBody(const FunctionBody& body) {
  if (body.kind == FunctionBody::Kind::kBuiltin) {
    auto it = Builtins().find(body.name);
    if (it == Builtins().end()) {
      return absl::NotFoundError(absl::StrCat("unknown built-in kernel '", body.name,
                                              "'; known: ", absl::StrJoin(BuiltinKernelNames(), ", ")));
    }
    return std::make_shared<BuiltinExecutable>(body.name, it->second);
  }
  std::shared_ptr<torch::jit::CompilationUnit> unit;
  try {
    unit = torch::jit::compile(body.source);
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

void ConfigureComputeThreads(int intra_op_threads) {
  at::set_num_threads(intra_op_threads);
  // OpenBLAS keeps its own pool; bound it too when the library is loaded.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(intra_op_threads);
  }
}

}  // namespace pathways
