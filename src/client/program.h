// Traced programs: many compiled-function calls recorded once and run with one client call.
//
// The program is the high-level IR of the paper's Figure 2: it knows only virtual slices and
// shardings, and its graph has one node per call whatever the number of shards: a chain A -> B
// is Arg -> A -> B -> Result on 1 device or on 1024.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace pathways {

// A value inside a program being traced: an argument or one output of a call. Only meaningful
// with the ProgramBuilder that made it.
class TracedValue {
 public:
  const TensorSpec& spec() const { return spec_; }

 private:
  friend class ProgramBuilder;
  bool is_arg_ = false;
  int index_ = 0;   // argument index, or call index
  int output_ = 0;  // output of that call
  TensorSpec spec_;
  const void* builder_ = nullptr;
};

// An immutable traced program. Cheap to copy; thread-safe.
class Program {
 public:
  struct Value {
    bool is_arg;
    int index;
    int output;
  };
  struct Call {
    CompiledFunction function;
    VirtualSlice slice;
    std::vector<Value> inputs;
    bool data_dependent_shapes;
  };

  TracedProgramId id() const { return data_->id; }
  const std::string& name() const { return data_->name; }
  const std::vector<TensorSpec>& arg_specs() const { return data_->args; }
  const std::vector<Call>& calls() const { return data_->calls; }
  const std::vector<Value>& results() const { return data_->results; }
  // Arguments that a call takes at a donated position: running the program spends their handles.
  const std::vector<int>& donated_args() const { return data_->donated_args; }
  // The graph: one node per argument, one per call and one Result node; one edge per use of a
  // value by a call or by the Result node. Independent of shard counts.
  int64_t num_graph_nodes() const;
  int64_t num_graph_edges() const;
  // Readable IR, e.g. `%1 = add_one(%0) on slice 3 {x=8} in (x) out (x) : f32[8]`.
  std::string ToString() const;

 private:
  friend class ProgramBuilder;
  struct Data {
    TracedProgramId id;
    std::string name;
    std::vector<TensorSpec> args;
    std::vector<Call> calls;
    std::vector<Value> results;
    std::vector<int> donated_args;
  };
  std::shared_ptr<const Data> data_;
};

// Records calls into a Program. Not thread-safe; one builder per trace.
class ProgramBuilder {
 public:
  explicit ProgramBuilder(std::string name);
  TracedValue Arg(const TensorSpec& spec);
  // Checks the call against the function's signature, as Client::Call does, and records it. A
  // value given at a donated position cannot be used after that call, nor at another of its
  // inputs; calls before it may read it (hosts hand its buffer over once they are done with it).
  absl::StatusOr<std::vector<TracedValue>> Call(const CompiledFunction& function,
                                                const VirtualSlice& slice,
                                                absl::Span<const TracedValue> inputs);
  // The program returning `results` (outputs of calls).
  absl::StatusOr<Program> Build(absl::Span<const TracedValue> results);

 private:
  absl::Status Check(const TracedValue& v) const;
  using ValueKey = std::tuple<bool, int, int>;  // is_arg, index, output
  static ValueKey Key(const TracedValue& v) { return {v.is_arg_, v.index_, v.output_}; }
  std::string Describe(const ValueKey& key) const;
  Program::Data data_;
  std::map<ValueKey, int> donated_;  // the call each donated value went to
  std::vector<std::vector<TensorSpec>> call_outputs_;
};

}  // namespace pathways
