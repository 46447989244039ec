// Vector-Jacobian products of libtorch bodies, computed with libtorch's autograd.
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "collective/collective.h"
#include "compute/body_heap.h"
#include "compute/torch_executable.h"
#include "compute/torch_ops.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

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
  // The graph's nodes and saved metadata (not its tensors, which the device's allocator charges),
  // charged to the device for as long as the handle lives.
  std::shared_ptr<MemoryBudget> budget;
  int64_t graph_bytes = 0;
  ~KeptResiduals() override {
    if (graph_bytes > 0) budget->Release(graph_bytes);
  }
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
  int64_t held_bytes() const override { return primal_->held_bytes(); }

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
    ScopedBodyHeap* heap = CurrentBodyHeap();
    const int64_t held_before = heap != nullptr ? heap->live_bytes() : 0;
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
    // The graph's own memory stays with the handle too: handed over from the body's heap (which
    // would release its charge as the run ends), with what the heap had charged of it, and charged
    // to the device until the handle goes. Before, a forward pass of a million small ops kept its
    // graph in the host's memory, uncharged.
    // The heap's budget is the device's (TorchExecutable::Run), and what it hands over is charged there.
    if (heap != nullptr && heap->budget() != nullptr) {
      const std::shared_ptr<MemoryBudget>& budget = heap->budget();
      int64_t moved = 0;
      const int64_t graph_bytes = heap->HandOver(heap->live_bytes() - held_before, &moved);
      if (graph_bytes > moved) {
        absl::Status charged = budget->Charge(graph_bytes - moved, budget->kernel_wait());
        if (!charged.ok()) {
          if (moved > 0) budget->Release(moved);
          return absl::ResourceExhaustedError(absl::StrCat("function '", name(), "' keeps its residuals' graph of ",
                                                           graph_bytes, " bytes: ", charged.message()));
        }
      }
      if (graph_bytes > 0) {
        kept->budget = budget;
        kept->graph_bytes = graph_bytes;
        kept_bytes += graph_bytes;
      }
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

}  // namespace

std::shared_ptr<const Executable> MakeVjpExecutable(std::string name, std::shared_ptr<const TorchExecutable> primal,
                                                    FunctionBody::Gradient gradient, std::string forward_key) {
  return std::make_shared<VjpExecutable>(std::move(name), std::move(primal), std::move(gradient),
                                         std::move(forward_key));
}

}  // namespace pathways
