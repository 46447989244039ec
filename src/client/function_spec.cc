// FunctionSpec: the spec's constructors, the donation it implies, its vector-Jacobian product, and
// the checks a spec passes before it is compiled.
#include "client/function_spec.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

// A partition spec with one entry per dimension ("" where not split), so that equal layouts compare equal.
PartitionSpec Padded(const std::vector<PartitionSpec>& specs, size_t index, size_t rank) {
  PartitionSpec spec = specs.empty() ? PartitionSpec{} : specs[index];
  spec.resize(std::max(spec.size(), rank));
  return spec;
}

}  // namespace

absl::Status CheckTensorSpec(const TensorSpec& spec, const std::string& what) {
  auto size = ByteSize(spec.dtype, spec.shape);
  if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", size.status().message()));
  return absl::OkStatus();
}

absl::Status ValidateFunctionSpec(const FunctionSpec& spec) {
  const std::string& name = spec.body.name;
  if (name.empty()) return absl::InvalidArgumentError("a function needs a name");
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    PW_RETURN_IF_ERROR(CheckTensorSpec(spec.inputs[i], absl::StrCat("function '", name, "' input ", i)));
  }
  for (size_t i = 0; i < spec.outputs.size(); ++i) {
    PW_RETURN_IF_ERROR(CheckTensorSpec(spec.outputs[i], absl::StrCat("function '", name, "' output ", i)));
  }
  if (!spec.in_shardings.empty() && spec.in_shardings.size() != spec.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' has ", spec.inputs.size(),
                                                   " inputs but ", spec.in_shardings.size(),
                                                   " input shardings"));
  }
  if (!spec.out_shardings.empty() && spec.out_shardings.size() != spec.outputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' has ", spec.outputs.size(),
                                                   " outputs but ", spec.out_shardings.size(),
                                                   " output shardings"));
  }
  if (!spec.donated_inputs.empty() && spec.body.gradient.has_value() &&
      spec.body.gradient->residuals == FunctionBody::Residuals::kKeep) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' keeps residuals, which view its inputs: ",
                                                   "it cannot take a donated input's buffer"));
  }
  std::set<int> donated;
  for (int i : spec.donated_inputs) {
    if (i < 0 || i >= static_cast<int>(spec.inputs.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("function '", name, "' donates input ", i, " but has ", spec.inputs.size(), " inputs"));
    }
    if (!donated.insert(i).second) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' donates input ", i, " twice"));
    }
  }
  const std::vector<int> donors = spec.OutputDonors();
  for (int i : spec.donated_inputs) {
    if (std::find(donors.begin(), donors.end(), i) == donors.end()) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' donates input ", i, " (",
                                                     spec.inputs[i].ToString(), ") but no output has its spec and sharding"));
    }
  }
  return absl::OkStatus();
}

FunctionSpec FunctionSpec::Builtin(std::string kernel, std::vector<TensorSpec> inputs,
                                   std::vector<TensorSpec> outputs,
                                   std::vector<PartitionSpec> in_shardings,
                                   std::vector<PartitionSpec> out_shardings) {
  return FunctionSpec{{FunctionBody::Kind::kBuiltin, std::move(kernel), ""},
                      std::move(inputs), std::move(outputs), std::move(in_shardings),
                      std::move(out_shardings)};
}

FunctionSpec FunctionSpec::Script(std::string name, std::string source,
                                  std::vector<TensorSpec> inputs, std::vector<TensorSpec> outputs,
                                  std::vector<PartitionSpec> in_shardings,
                                  std::vector<PartitionSpec> out_shardings) {
  return FunctionSpec{{FunctionBody::Kind::kTorchScript, std::move(name), std::move(source)},
                      std::move(inputs), std::move(outputs), std::move(in_shardings),
                      std::move(out_shardings)};
}

std::vector<int> FunctionSpec::OutputDonors() const {
  std::vector<int> donors(outputs.size(), -1);
  for (int i : donated_inputs) {
    if (i < 0 || i >= static_cast<int>(inputs.size())) continue;
    const PartitionSpec in = Padded(in_shardings, i, inputs[i].shape.size());
    for (size_t j = 0; j < outputs.size(); ++j) {
      if (donors[j] == -1 && outputs[j] == inputs[i] && Padded(out_shardings, j, outputs[j].shape.size()) == in) {
        donors[j] = i;
        break;
      }
    }
  }
  return donors;
}

absl::StatusOr<FunctionSpec> FunctionSpec::Vjp(const FunctionSpec& primal, std::vector<int> wrt, bool with_outputs) {
  PW_RETURN_IF_ERROR(ValidateFunctionSpec(primal));
  const std::string& name = primal.body.name;
  if (primal.body.gradient) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is already a gradient; gradients of gradients are not supported"));
  }
  auto floating = [](DType d) { return d == DType::kF32 || d == DType::kF64; };
  if (wrt.empty()) {
    for (size_t i = 0; i < primal.inputs.size(); ++i) {
      if (floating(primal.inputs[i].dtype)) wrt.push_back(static_cast<int>(i));
    }
  }
  auto in_sharding = [&](size_t i) { return primal.in_shardings.empty() ? PartitionSpec{} : primal.in_shardings[i]; };
  auto out_sharding = [&](size_t k) { return primal.out_shardings.empty() ? PartitionSpec{} : primal.out_shardings[k]; };
  FunctionSpec vjp;
  vjp.body = primal.body;
  vjp.body.name = name;
  FunctionBody::Gradient gradient;
  gradient.wrt = wrt;
  gradient.with_outputs = with_outputs;
  for (size_t i = 0; i < primal.inputs.size(); ++i) {
    vjp.inputs.push_back(primal.inputs[i]);
    vjp.in_shardings.push_back(in_sharding(i));
    gradient.in_specs.push_back(in_sharding(i));
  }
  for (size_t k = 0; k < primal.outputs.size(); ++k) {
    gradient.out_specs.push_back(out_sharding(k));
    if (with_outputs) {
      vjp.outputs.push_back(primal.outputs[k]);
      vjp.out_shardings.push_back(out_sharding(k));
    }
    if (!floating(primal.outputs[k].dtype)) continue;
    vjp.inputs.push_back(primal.outputs[k]);
    vjp.in_shardings.push_back(out_sharding(k));
  }
  for (int i : wrt) {
    if (i < 0 || i >= static_cast<int>(primal.inputs.size())) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of '", name, "' with respect to input ", i,
                                                     ", but it has ", primal.inputs.size(), " inputs"));
    }
    if (!floating(primal.inputs[i].dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of '", name, "' with respect to input ", i, ", which is ",
                                                     DTypeName(primal.inputs[i].dtype), ", not floating point"));
    }
    vjp.outputs.push_back(primal.inputs[i]);
    vjp.out_shardings.push_back(in_sharding(i));
  }
  vjp.body.gradient = std::move(gradient);
  PW_RETURN_IF_ERROR(ValidateFunctionBody(vjp.body));
  vjp.data_dependent_shapes = primal.data_dependent_shapes;
  return vjp;
}

absl::StatusOr<FunctionSpec::SplitVjp> FunctionSpec::VjpKeepingResiduals(const FunctionSpec& primal,
                                                                         std::vector<int> wrt) {
  PW_ASSIGN_OR_RETURN(FunctionSpec whole, Vjp(primal, std::move(wrt)));
  const auto primal_inputs = static_cast<std::ptrdiff_t>(primal.inputs.size());
  const TensorSpec handle{DType::kI64, {}};
  SplitVjp split;
  FunctionSpec& forward = split.forward;
  forward.body = whole.body;
  forward.body.gradient->residuals = FunctionBody::Residuals::kKeep;
  forward.inputs = primal.inputs;
  forward.in_shardings.assign(whole.in_shardings.begin(), whole.in_shardings.begin() + primal_inputs);
  forward.outputs = primal.outputs;
  forward.outputs.push_back(handle);
  if (!primal.out_shardings.empty()) {
    forward.out_shardings = primal.out_shardings;
    forward.out_shardings.push_back({});
  }
  forward.data_dependent_shapes = primal.data_dependent_shapes;
  FunctionSpec& backward = split.backward;
  backward.body = whole.body;
  backward.body.gradient->residuals = FunctionBody::Residuals::kUse;
  backward.inputs = {handle};
  backward.inputs.insert(backward.inputs.end(), whole.inputs.begin() + primal_inputs, whole.inputs.end());
  backward.in_shardings = {{}};
  backward.in_shardings.insert(backward.in_shardings.end(), whole.in_shardings.begin() + primal_inputs,
                               whole.in_shardings.end());
  backward.outputs = whole.outputs;
  backward.out_shardings = whole.out_shardings;
  PW_RETURN_IF_ERROR(ValidateFunctionBody(forward.body));
  PW_RETURN_IF_ERROR(ValidateFunctionBody(backward.body));
  return split;
}

}  // namespace pathways
