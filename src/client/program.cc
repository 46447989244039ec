#include "client/program.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/ids.h"

namespace pathways {
namespace {

IdGenerator<TracedProgramId>& ProgramIds() {
  static IdGenerator<TracedProgramId> ids;
  return ids;
}

std::string ValueName(const Program::Value& v, const std::vector<Program::Call>& calls) {
  if (v.is_arg) return absl::StrCat("%arg", v.index);
  if (calls[v.index].function.spec().outputs.size() == 1) return absl::StrCat("%", v.index);
  return absl::StrCat("%", v.index, "#", v.output);
}

std::string ShardingsToString(const std::vector<PartitionSpec>& specs, size_t n) {
  if (specs.empty()) return std::string(n == 0 ? "()" : "replicated");
  std::vector<std::string> parts;
  for (const auto& s : specs) parts.push_back(PartitionSpecToString(s));
  return absl::StrJoin(parts, " ");
}

}  // namespace

int64_t Program::num_graph_nodes() const {
  return static_cast<int64_t>(data_->args.size() + data_->calls.size()) + 1;
}

int64_t Program::num_graph_edges() const {
  int64_t edges = static_cast<int64_t>(data_->results.size());
  for (const Call& c : data_->calls) edges += static_cast<int64_t>(c.inputs.size());
  return edges;
}

std::string Program::ToString() const {
  std::vector<std::string> args;
  for (size_t i = 0; i < data_->args.size(); ++i) args.push_back(absl::StrCat("%arg", i, ": ", data_->args[i].ToString()));
  std::string out = absl::StrCat("program ", data_->name, "(", absl::StrJoin(args, ", "), ") {\n");
  for (size_t n = 0; n < data_->calls.size(); ++n) {
    const Call& c = data_->calls[n];
    const FunctionSpec& spec = c.function.spec();
    std::vector<std::string> inputs, outputs;
    for (const Value& v : c.inputs) inputs.push_back(ValueName(v, data_->calls));
    for (const TensorSpec& o : spec.outputs) outputs.push_back(o.ToString());
    absl::StrAppend(&out, "  %", n, " = ", spec.body.DisplayName(), "(", absl::StrJoin(inputs, ", "), ") on slice ",
                    c.slice.id().value(), " ", c.slice.mesh().ToString(), " in ",
                    ShardingsToString(spec.in_shardings, spec.inputs.size()), " out ",
                    ShardingsToString(spec.out_shardings, spec.outputs.size()), " : ",
                    absl::StrJoin(outputs, ", "), c.data_dependent_shapes ? "  [data-dependent]" : "",
                    spec.donated_inputs.empty() ? "" : absl::StrCat("  [donates ", absl::StrJoin(spec.donated_inputs, ","), "]"),
                    "\n");
  }
  std::vector<std::string> results;
  for (const Value& v : data_->results) results.push_back(ValueName(v, data_->calls));
  absl::StrAppend(&out, "  return ", absl::StrJoin(results, ", "), "\n}\n");
  return out;
}

ProgramBuilder::ProgramBuilder(std::string name) {
  data_.id = ProgramIds().Next();
  data_.name = std::move(name);
}

TracedValue ProgramBuilder::Arg(const TensorSpec& spec) {
  TracedValue v;
  v.is_arg_ = true;
  v.index_ = static_cast<int>(data_.args.size());
  v.spec_ = spec;
  v.builder_ = this;
  data_.args.push_back(spec);
  return v;
}

std::string ProgramBuilder::Describe(const ValueKey& key) const {
  const auto& [is_arg, index, output] = key;
  return is_arg ? absl::StrCat("argument ", index) : absl::StrCat("output ", output, " of call ", index);
}

absl::Status ProgramBuilder::Check(const TracedValue& v) const {
  if (v.builder_ != this) return absl::InvalidArgumentError("a traced value from another program builder");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TracedValue>> ProgramBuilder::Call(const CompiledFunction& function,
                                                              const VirtualSlice& slice,
                                                              absl::Span<const TracedValue> inputs) {
  const FunctionSpec& spec = function.spec();
  const std::string& name = spec.body.name;
  if (inputs.size() != spec.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' takes ", spec.inputs.size(),
                                                   " inputs, got ", inputs.size()));
  }
  Program::Call call{function, slice, {}, spec.data_dependent_shapes};
  const int index = static_cast<int>(data_.calls.size());
  std::map<ValueKey, int> uses_here;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (absl::Status s = Check(inputs[i]); !s.ok()) return s;
    if (inputs[i].spec() != spec.inputs[i]) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' input ", i, " must be ",
                                                     spec.inputs[i].ToString(), ", got ", inputs[i].spec().ToString()));
    }
    const ValueKey key = Key(inputs[i]);
    if (auto d = donated_.find(key); d != donated_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' input ", i, ": ", Describe(key),
                                                     " was donated to call ", d->second, " and cannot be used again"));
    }
    ++uses_here[key];
    call.inputs.push_back({inputs[i].is_arg_, inputs[i].index_, inputs[i].output_});
  }
  for (int i : spec.donated_inputs) {
    const ValueKey key = Key(inputs[i]);
    if (uses_here[key] > 1) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' takes ", Describe(key), " at donated input ", i,
                                                     " and at another input too"));
    }
  }
  for (int i : spec.donated_inputs) {
    donated_[Key(inputs[i])] = index;
    if (inputs[i].is_arg_) data_.donated_args.push_back(inputs[i].index_);
  }
  data_.calls.push_back(std::move(call));
  std::vector<TracedValue> outputs;
  for (size_t j = 0; j < spec.outputs.size(); ++j) {
    TracedValue v;
    v.index_ = index;
    v.output_ = static_cast<int>(j);
    v.spec_ = spec.outputs[j];
    v.builder_ = this;
    outputs.push_back(v);
  }
  return outputs;
}

absl::StatusOr<Program> ProgramBuilder::Build(absl::Span<const TracedValue> results) {
  if (data_.calls.empty()) return absl::InvalidArgumentError(absl::StrCat("program '", data_.name, "' has no calls"));
  auto data = std::make_shared<Program::Data>(data_);
  for (const TracedValue& r : results) {
    if (absl::Status s = Check(r); !s.ok()) return s;
    if (r.is_arg_) return absl::InvalidArgumentError("a program result must be the output of a call");
    if (auto d = donated_.find(Key(r)); d != donated_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("program result ", Describe(Key(r)), " was donated to call ", d->second));
    }
    data->results.push_back({false, r.index_, r.output_});
  }
  data_.id = ProgramIds().Next();  // a builder reused after Build makes a new program
  Program program;
  program.data_ = std::move(data);
  return program;
}

}  // namespace pathways
