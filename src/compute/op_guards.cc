#include "compute/op_guards.h"

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "compute/body_heap.h"
#include "compute/stop_request.h"
#include "compute/torch_ops.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

// Integer tensors' quotients and remainders check for a zero divisor but not for the lowest value
// of their type divided by -1 (SIGFPE). True division (div without a rounding mode) gives floats.
bool IsTensorIntegerDivision(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  const auto& arguments = schema.arguments();
  if (arguments.size() < 2 || (arguments[0].type()->kind() != c10::TypeKind::TensorType &&
                               arguments[1].type()->kind() != c10::TypeKind::TensorType)) {
    return false;  // TorchScript's numbers: CheckedLanguageOps
  }
  if (name == "aten::div" || name == "aten::div_" || name == "aten::divide" || name == "aten::divide_") {
    return absl::EndsWith(schema.overload_name(), "_mode");
  }
  return name == "aten::floor_divide" || name == "aten::floor_divide_" || name == "aten::remainder" ||
         name == "aten::remainder_" || name == "aten::fmod" || name == "aten::fmod_";
}

void CheckQuotient(const at::Tensor& a, const at::Tensor& b) {
  const at::ScalarType type = at::result_type(a, b);
  if (!at::isIntegralType(type, /*includeBool=*/false) || type == at::kByte) return;
  at::Tensor lowest;
  AT_DISPATCH_INTEGRAL_TYPES(type, "checked_quotient", [&] {
    lowest = at::scalar_tensor(std::numeric_limits<scalar_t>::lowest(), at::TensorOptions().dtype(type));
  });
  // Compared as the kernel will see them: in the result's type (2^31 of an int64 is -2^31 in int32).
  PW_OP_CHECK(!at::logical_and(at::eq(a.to(type), lowest), at::eq(b.to(type), -1)).any().item<bool>(),
              "integer division overflows: the lowest ", c10::toString(type), " by -1");
}
at::Tensor CheckedQuotient(const at::Tensor& a, const at::Tensor& b) {
  CheckQuotient(a, b);
  return b;
}
at::Scalar CheckedQuotientScalar(const at::Tensor& a, const at::Scalar& b) {
  CheckQuotient(a, at::scalar_to_tensor(b));
  return b;
}
at::Tensor CheckedQuotientScalarTensor(const at::Scalar& a, const at::Tensor& b) {
  CheckQuotient(at::scalar_to_tensor(a), b);
  return b;
}

// Kernels keep many int arguments in 32 bits (conv's groups and padding, a pool's divisor, a
// kernel size): 2^32 wrapped to 0 and raised SIGFPE, 2^63-1 read out of bounds, -2^63 hung. An int
// argument of an op on tensors is let through within 32 bits, but for the ops whose ints are
// values rather than sizes (a tensor of one int, random integers' bounds).
constexpr int64_t kIntBound = std::numeric_limits<int32_t>::max();

bool BoundsInts(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  if (name == "aten::tensor" || name == "aten::as_tensor" || name == "aten::randint" || name == "aten::randint_like") {
    return false;
  }
  auto tensors = [](const std::vector<c10::Argument>& arguments) {
    for (const c10::Argument& a : arguments) {
      if (a.type()->kind() == c10::TypeKind::TensorType) return true;
      if (auto optional = a.type()->cast<c10::OptionalType>()) {
        if (optional->getElementType()->kind() == c10::TypeKind::TensorType) return true;
      }
      if (auto list = a.type()->cast<c10::ListType>()) {
        if (list->getElementType()->kind() == c10::TypeKind::TensorType) return true;
      }
    }
    return false;
  };
  return absl::StartsWith(name, "aten::") && (tensors(schema.arguments()) || tensors(schema.returns()));
}

enum class IntArgument { kNone, kInt, kIntList };

IntArgument IntArgumentOf(const c10::TypePtr& real_type) {
  c10::TypePtr type = real_type;
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  if (type->kind() == c10::TypeKind::IntType || type->kind() == c10::TypeKind::SymIntType) return IntArgument::kInt;
  if (auto list = type->cast<c10::ListType>()) {
    const c10::TypeKind element = list->getElementType()->kind();
    if (element == c10::TypeKind::IntType || element == c10::TypeKind::SymIntType) return IntArgument::kIntList;
  }
  return IntArgument::kNone;
}

std::string BadInt(int64_t value) {
  if (value >= -kIntBound && value <= kIntBound) return "";
  return absl::StrCat(value, " is past 32 bits, which ops on tensors keep their int arguments to");
}

int64_t CheckedInt(int64_t value) {
  const std::string bad = BadInt(value);
  PW_OP_CHECK(bad.empty(), bad);
  return value;
}
std::vector<int64_t> CheckedInts(std::vector<int64_t> values) {
  for (int64_t v : values) CheckedInt(v);
  return values;
}

// Each check's form for an Optional argument: None passes.
template <typename T, T (*check)(T)>
c10::optional<T> OrNone(c10::optional<T> value) {
  if (value.has_value()) check(*value);
  return value;
}

// The enumerations TorchScript passes as plain ints, which kernels index tables with (dtype 99 raised
// SIGFPE; -1 hung or crashed), and devices. Only these values are let through: the real dtypes
// (complex kernels are less tried; a complex literal still makes a complex tensor, whose dtype
// passes), strided tensors (the others are sparse or MKL-DNN layouts), the memory formats there
// are, and the CPU.
enum class Enumeration { kDType, kLayout, kMemoryFormat, kDevice };

std::optional<Enumeration> EnumerationOf(const c10::Argument& argument) {
  c10::TypePtr type = argument.real_type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  switch (type->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return Enumeration::kDType;
    case c10::TypeKind::IntType:  // TorchScript's own overloads (to.prim_dtype) take a dtype as an int
      if (argument.name() == "dtype") return Enumeration::kDType;
      return std::nullopt;
    case c10::TypeKind::DeviceObjType:
      return Enumeration::kDevice;
    case c10::TypeKind::LayoutType:
      return Enumeration::kLayout;
    case c10::TypeKind::MemoryFormatType:
      return Enumeration::kMemoryFormat;
    default:
      return std::nullopt;
  }
}

// Empty when `value` is one the enumeration lets through.
std::string BadEnumeration(Enumeration kind, int64_t value) {
  using c10::ScalarType;
  switch (kind) {
    case Enumeration::kDType:
      for (ScalarType t :
           {ScalarType::Byte, ScalarType::Char, ScalarType::Short, ScalarType::Int, ScalarType::Long, ScalarType::Half,
            ScalarType::Float, ScalarType::Double, ScalarType::Bool, ScalarType::BFloat16}) {
        if (value == static_cast<int64_t>(t)) return "";
      }
      return absl::StrCat("dtype ", value, " is none of the dtypes a function may use");
    case Enumeration::kLayout:
      if (value == static_cast<int64_t>(c10::Layout::Strided)) return "";
      return absl::StrCat("layout ", value, " is not torch.strided, the one layout a function may use");
    case Enumeration::kMemoryFormat:
      if (value >= 0 && value < static_cast<int64_t>(c10::MemoryFormat::NumOptions)) return "";
      return absl::StrCat("memory format ", value, " names none");
    case Enumeration::kDevice:
      return "";  // devices are not ints (BadDevice)
  }
  return "";
}

// A device other than the CPU: a meta tensor has no memory, and its data pointer is any number
// (an offset into nothing) that a read of it would follow.
std::string BadDevice(const c10::Device& device) {
  if (device.is_cpu()) return "";
  return absl::StrCat("device '", device.str(), "' is not the CPU, the one device a function's tensors may be on");
}

c10::Device CheckedDevice(c10::Device device) {
  const std::string bad = BadDevice(device);
  PW_OP_CHECK(bad.empty(), bad);
  return device;
}

template <Enumeration kind>
int64_t Checked(int64_t value) {
  const std::string bad = BadEnumeration(kind, value);
  PW_OP_CHECK(bad.empty(), bad);
  return value;
}

const char* GuardOf(Enumeration kind) {
  switch (kind) {
    case Enumeration::kDType:
      return "pathways::checked_dtype";
    case Enumeration::kLayout:
      return "pathways::checked_layout";
    case Enumeration::kMemoryFormat:
      return "pathways::checked_memory_format";
    case Enumeration::kDevice:
      return "pathways::checked_device";
  }
  return "";
}

std::string Where(const torch::jit::Node& node) {
  auto at = node.sourceRange().file_line_col();
  return at ? absl::StrCat(" (", std::get<0>(*at), ":", std::get<1>(*at), ")") : "";
}

// Why `node` may not be in a body under `ops`; empty when it may.
std::string Refusal(const torch::jit::Node& node, FunctionOps ops) {
  const c10::Symbol kind = node.kind();
  std::string why = RefusedOp(kind.ns().toUnqualString(), kind.toUnqualString(), ops);
  if (!why.empty()) return why;
  const c10::FunctionSchema* schema = node.maybeSchema();
  if (schema == nullptr) return "";
  for (const c10::Argument& argument : schema->arguments()) {
    if (argument.is_out()) return "it writes into a tensor given as out= (a kernel wrote past one); use its result";
  }
  const std::string& overload = schema->overload_name();
  if ((schema->name() == "aten::sort" || schema->name() == "aten::sorted") &&
      (overload == "float" || overload == "Tensor" || overload == "any")) {
    return "sorting a list of floats or tensors holding NaN reads outside the list; sort a tensor instead";
  }
  if (schema->name() == "aten::searchsorted") {
    // A `sorter` is not checked against the sequence: its indices are followed as they are.
    const auto sorter = schema->argumentIndexWithName("sorter");
    if (sorter.has_value() && *sorter < node.inputs().size() && !node.input(*sorter)->mustBeNone()) {
      return "with a sorter it can reach memory outside its tensors (the sorter's indices are not checked)";
    }
  }
  return "";
}

// Puts the checks in front of `node`'s trusted arguments. InvalidArgument for a constant that no
// check would let through.
absl::Status Guard(torch::jit::Node* node) {
  const c10::FunctionSchema* schema = node->maybeSchema();
  if (schema == nullptr) return absl::OkStatus();
  torch::jit::Graph& graph = *node->owningGraph();
  torch::jit::WithInsertPoint before(node);
  const auto& arguments = schema->arguments();
  const bool bounds_ints = BoundsInts(*schema);
  for (size_t i = 0; i < arguments.size() && i < node->inputs().size(); ++i) {
    torch::jit::Value* value = node->input(i);
    if (value->mustBeNone()) continue;
    const std::optional<Enumeration> enumeration = EnumerationOf(arguments[i]);
    const IntArgument ints = bounds_ints ? IntArgumentOf(arguments[i].real_type()) : IntArgument::kNone;
    if (!enumeration.has_value() && ints == IntArgument::kNone) continue;
    // Constants are checked now, and so are a list's constant elements; a list is checked as the
    // body runs all the same, as it may change before it is used (`p[0] = ...`). Sizes are not
    // trusted either: an expanded tensor has 2^32 elements in no memory.
    const bool list = value->node()->kind() == c10::prim::ListConstruct;
    const std::vector<torch::jit::Value*> elements = list ? value->node()->inputs().vec() : std::vector{value};
    bool constant = true;
    std::string bad;
    for (torch::jit::Value* element : elements) {
      const auto known = torch::jit::toIValue(element);
      if (!known.has_value()) {
        constant = false;
        continue;
      }
      std::vector<int64_t> numbers;
      if (known->isInt()) numbers = {known->toInt()};
      if (known->isIntList()) numbers = known->toIntVector();
      if (enumeration.has_value() && known->isDevice()) bad = BadDevice(known->toDevice());
      for (int64_t v : numbers) {
        if (bad.empty()) bad = enumeration.has_value() ? BadEnumeration(*enumeration, v) : BadInt(v);
      }
      if (!bad.empty()) return absl::InvalidArgumentError(absl::StrCat(schema->name(), Where(*node), ": ", bad));
    }
    if (constant && !list) continue;
    const char* guard = enumeration.has_value()     ? GuardOf(*enumeration)
                        : ints == IntArgument::kInt ? "pathways::checked_int"
                                                    : "pathways::checked_ints";
    node->replaceInput(i, graph.insert(c10::Symbol::fromQualString(guard), {value}));
  }
  if (IsTensorIntegerDivision(*schema) && node->inputs().size() >= 2) {
    node->replaceInput(
        1, graph.insert(c10::Symbol::fromQualString("pathways::checked_quotient"), {node->input(0), node->input(1)}));
  }
  return absl::OkStatus();
}

// TorchScript's own ops on numbers and strings that trust their arguments: the C++ divides
// integers unchecked (`a % 0`, `a // 0` and -2^63 by -1 in `//`, `%`, divmod and gcd raise
// SIGFPE), and a string's count and replace of an empty string never end. The compiler runs such
// ops on constants while it defines a function (constant propagation), so a check in the function's
// graph would come too late: each is replaced, once per process, by one that checks its arguments
// and then runs the original (which constant propagation then sees throw, and leaves to the run).
void CheckDivision(const c10::IValue& a, const c10::IValue& b) {
  if (!a.isInt() || !b.isInt()) return;  // floats, or Scalars holding them
  TORCH_CHECK(b.toInt() != 0, "integer division or modulo by zero");
  TORCH_CHECK(!(a.toInt() == std::numeric_limits<int64_t>::min() && b.toInt() == -1),
              "integer division overflows: -2^63 by -1");
}

void CheckSubstring(const c10::IValue& substring) {
  TORCH_CHECK(substring.isString() && !substring.toStringRef().empty(),
              "an empty string cannot be counted or replaced in a string");
}

// TorchScript's string and list ops run one loop each in C++, where no stop point can ask them
// to stop, and their elements may all be one shared string or tensor: `[s] * 10**6` holds a
// 4 MB string once, and counting another 4 MB string in it compares 4 TB. The memory a body
// holds does not bound their time, so their steps are bounded here instead.
constexpr int64_t kMaxSteps = int64_t{1} << 32;

// What comparing or hashing `v` may read: a string's characters, a tensor's elements, 1 else.
int64_t WeightOf(const c10::IValue& v) {
  if (v.isString()) return static_cast<int64_t>(v.toStringRef().size());
  if (v.isTensor()) return v.toTensor().numel();
  return 1;
}

// The heaviest element of `list` (strings, tensors or the keys of (key, value) tuples), 1 for none.
int64_t HeaviestOf(const c10::IValue& list) {
  int64_t heaviest = 1;
  if (!list.isList()) return WeightOf(list);
  for (const c10::IValue& e : list.toListRef()) {
    const c10::IValue& key = e.isTuple() && !e.toTupleRef().elements().empty() ? e.toTupleRef().elements()[0] : e;
    heaviest = std::max(heaviest, WeightOf(key));
  }
  return heaviest;
}

int64_t LengthOf(const c10::IValue& v) {
  if (v.isString()) return static_cast<int64_t>(v.toStringRef().size());
  if (v.isList()) return static_cast<int64_t>(v.toListRef().size());
  return 1;
}

void CheckSteps(const char* op, int64_t count, int64_t weight) {
  weight = std::max<int64_t>(weight, 1);
  TORCH_CHECK(count <= kMaxSteps / weight, op, " would take about ", count, " x ", weight,
              " steps, past the 2^32 one op of a body may take (a single op cannot be asked to stop)");
}

struct CheckedLanguageOps {
  CheckedLanguageOps() {
    auto divide = [](torch::jit::Stack& stack) {
      CheckDivision(torch::jit::peek(stack, 0, 2), torch::jit::peek(stack, 1, 2));
    };
    for (const char* name : {"aten::remainder.int", "aten::remainder", "aten::floordiv.int", "aten::floordiv",
                             "aten::divmod.int", "aten::__round_to_zero_floordiv.int"}) {
      Wrap(name, divide);
    }
    // Euclid's steps divide by what the arguments become: -2^63 anywhere can meet -1.
    Wrap("aten::gcd.int", [](torch::jit::Stack& stack) {
      constexpr int64_t kLowest = std::numeric_limits<int64_t>::min();
      TORCH_CHECK(torch::jit::peek(stack, 0, 2).toInt() != kLowest && torch::jit::peek(stack, 1, 2).toInt() != kLowest,
                  "gcd of -2^63 overflows");
    });
    // Substring searches compare up to |self| x |substring| characters (and count and replace
    // of an empty substring never end).
    auto search = [](const char* op, int arity, bool nonempty) {
      return [op, arity, nonempty](torch::jit::Stack& stack) {
        const c10::IValue& self = torch::jit::peek(stack, 0, arity);
        const c10::IValue& substring = torch::jit::peek(stack, 1, arity);
        if (nonempty) CheckSubstring(substring);
        CheckSteps(op, LengthOf(self), LengthOf(substring));
      };
    };
    Wrap("aten::count", search("str.count", 4, true));
    Wrap("aten::replace", search("str.replace", 4, true));
    for (const char* name : {"aten::find", "aten::rfind", "aten::index.str", "aten::rindex"})
      Wrap(name, search(name, 4, false));
    Wrap("aten::split.str", search("str.split", 3, false));
    for (const char* name : {"aten::partition", "aten::rpartition", "aten::strip", "aten::lstrip", "aten::rstrip"}) {
      Wrap(name, search(name, 2, false));
    }
    // A list searched for an element compares it with each (a string or a tensor as a whole).
    auto find_in_list = [](const char* op) {
      return [op](torch::jit::Stack& stack) {
        CheckSteps(op, LengthOf(torch::jit::peek(stack, 0, 2)), WeightOf(torch::jit::peek(stack, 1, 2)));
      };
    };
    for (const char* type : {"int", "float", "bool", "Tensor", "str"}) {
      for (const std::string& name : {absl::StrCat("aten::count.", type), absl::StrCat("aten::remove.", type),
                                      absl::StrCat("aten::index.list_", type)}) {
        Wrap(name, find_in_list("a list's count, index or remove"));
      }
    }
    for (const char* name :
         {"aten::__contains__.int_list", "aten::__contains__.float_list", "aten::__contains__.str_list"}) {
      Wrap(name, find_in_list("'in' a list"));
    }
    // Lists compared, sorted or made into a dict compare or hash their elements.
    auto compare_lists = [](torch::jit::Stack& stack) {
      const c10::IValue& a = torch::jit::peek(stack, 0, 2);
      CheckSteps("comparing lists", LengthOf(a), HeaviestOf(a));
    };
    for (const char* type : {"int_list", "float_list", "Tensor_list", "bool_list", "str_list"}) {
      Wrap(absl::StrCat("aten::eq.", type), compare_lists);
      Wrap(absl::StrCat("aten::ne.", type), compare_lists);
    }
    auto sort = [](int arity) {
      return [arity](torch::jit::Stack& stack) {
        const c10::IValue& list = torch::jit::peek(stack, 0, arity);
        const int64_t n = LengthOf(list);
        int64_t log = 1;
        while ((int64_t{1} << log) < n && log < 62) ++log;
        CheckSteps("sorting a list", n * log, HeaviestOf(list));
      };
    };
    Wrap("aten::sort.str", sort(2));
    Wrap("aten::sorted.str", sort(1));
    Wrap("aten::dict.str", [](torch::jit::Stack& stack) {
      const c10::IValue& pairs = torch::jit::peek(stack, 0, 1);
      CheckSteps("a dict of strings", LengthOf(pairs), HeaviestOf(pairs));
    });
    // Repeating a list loops `n` times even when the list is empty.
    Wrap("aten::mul.left_t",
         [](torch::jit::Stack& stack) { CheckSteps("repeating a list", torch::jit::peek(stack, 1, 2).toInt(), 1); });
    Wrap("aten::mul.right_",
         [](torch::jit::Stack& stack) { CheckSteps("repeating a list", torch::jit::peek(stack, 0, 2).toInt(), 1); });
  }

  // Replaces the operator named `name` ("aten::op.overload") by one that calls `check` on its stack first.
  static void Wrap(const std::string& name, std::function<void(torch::jit::Stack&)> check) {
    const size_t dot = name.find('.');
    const c10::Symbol symbol = c10::Symbol::fromQualString(name.substr(0, dot));
    const std::string overload = dot == std::string::npos ? "" : name.substr(dot + 1);
    for (const std::shared_ptr<torch::jit::Operator>& op : torch::jit::getAllOperatorsFor(symbol)) {
      const c10::FunctionSchema schema = op->schema();
      if (schema.overload_name() != overload || schema.arguments().empty() ||
          schema.arguments()[0].type()->kind() == c10::TypeKind::TensorType) {
        continue;
      }
      torch::jit::Operation original = op->getOperation();
      const c10::AliasAnalysisKind alias = op->aliasAnalysisKind();
      torch::jit::deregisterOperator(schema);
      torch::jit::registerOperator(torch::jit::Operator(
          c10::toString(schema),
          [original = std::move(original), check](torch::jit::Stack& stack) mutable {
            check(stack);
            original(stack);
          },
          alias));
      return;
    }
    // None: this libtorch has no such op to check (ExecutableTest.ArgumentsKernelsTakeOnTrustFailTheRunNotTheWorker
    // sees each one's check).
  }
};
const CheckedLanguageOps checked_language_ops;

// Where a loop's turn polls the thread's stop request (compute/stop_request.h): the run fails at
// the next turn once the worker asked, and the host says why.
void StopPoint() {
  TORCH_CHECK(!StopRequested(), "the computation was asked to stop");
  TORCH_CHECK(!BodyHeapRefused(), "the computation ran out of memory");  // TorchExecutable::Run says how
}

}  // namespace

absl::Status ConfineBody(torch::jit::CompilationUnit& unit, const std::string& name, FunctionOps ops) {
  std::function<absl::Status(torch::jit::Block*)> confine = [&](torch::jit::Block* block) -> absl::Status {
    for (torch::jit::Node* node : block->nodes()) {
      const std::string why = Refusal(*node, ops);
      if (!why.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name, "' calls ", node->kind().toQualString(),
                                                       Where(*node), ", which a function may not call: ", why));
      }
      for (torch::jit::Block* inner : node->blocks()) PW_RETURN_IF_ERROR(confine(inner));
      // A body runs ops without end only by looping (TorchScript refuses recursion, and every
      // function of the unit is confined): each turn may be asked to stop.
      if (node->kind() == c10::prim::Loop) {
        torch::jit::Block* body = node->blocks().at(0);
        body->prependNode(body->owningGraph()->create(c10::Symbol::fromQualString("pathways::stop_point"), 0));
      }
      if (absl::Status guarded = Guard(node); !guarded.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name, "': ", guarded.message()));
      }
    }
    return absl::OkStatus();
  };
  // What the functions call of torch's own is torch's and is not looked into.
  for (torch::jit::Function* fn : unit.get_functions()) {
    PW_RETURN_IF_ERROR(confine(torch::jit::toGraphFunction(*fn).graph()->block()));
  }
  return absl::OkStatus();
}

// Pure checks, but registered as having side effects so that no optimisation drops or moves one (a
// stop point has no output at all).
TORCH_LIBRARY_FRAGMENT(pathways, m) {
  auto op = [](const char* schema) { return torch::schema(schema, c10::AliasAnalysisKind::CONSERVATIVE); };
  m.def(op("stop_point() -> ()"), &StopPoint);
  m.def(op("checked_quotient.Tensor(Tensor a, Tensor b) -> Tensor"), &CheckedQuotient);
  m.def(op("checked_quotient.Scalar(Tensor a, Scalar b) -> Scalar"), &CheckedQuotientScalar);
  m.def(op("checked_quotient.Scalar_Tensor(Scalar a, Tensor b) -> Tensor"), &CheckedQuotientScalarTensor);
  m.def(op("checked_int(int value) -> int"), &CheckedInt);
  m.def(op("checked_int.optional(int? value) -> int?"), &OrNone<int64_t, &CheckedInt>);
  m.def(op("checked_ints(int[] values) -> int[]"), &CheckedInts);
  m.def(op("checked_ints.optional(int[]? values) -> int[]?"), &OrNone<std::vector<int64_t>, &CheckedInts>);
  m.def(op("checked_device(Device device) -> Device"), &CheckedDevice);
  m.def(op("checked_device.optional(Device? device) -> Device?"), &OrNone<c10::Device, &CheckedDevice>);
  m.def(op("checked_dtype(int value) -> int"), &Checked<Enumeration::kDType>);
  m.def(op("checked_dtype.optional(int? value) -> int?"), &OrNone<int64_t, &Checked<Enumeration::kDType>>);
  m.def(op("checked_layout(int value) -> int"), &Checked<Enumeration::kLayout>);
  m.def(op("checked_layout.optional(int? value) -> int?"), &OrNone<int64_t, &Checked<Enumeration::kLayout>>);
  m.def(op("checked_memory_format(int value) -> int"), &Checked<Enumeration::kMemoryFormat>);
  m.def(op("checked_memory_format.optional(int? value) -> int?"),
        &OrNone<int64_t, &Checked<Enumeration::kMemoryFormat>>);
}

}  // namespace pathways
