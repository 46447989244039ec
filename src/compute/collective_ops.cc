// The collectives as `pathways.*` torch ops, with their gradients: `pathways.all_reduce(x, "x")`
// in TorchScript, and what the collective built-in kernels and gradient bodies call.
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#include <torch/torch.h>

#include "collective/collective.h"
#include "compute/body_heap.h"
#include "compute/torch_ops.h"

namespace pathways {
namespace {

// Collectives, as torch ops: `pathways.all_reduce(x, "x")` in TorchScript, and the collective
// built-in kernels. Each hands the shard's contiguous input and a fresh output to the runtime
// (collective/collective.h), which moves and reduces the bytes in place. Collectives along a
// dimension other than 0 move that dimension to the front first, so that the chunks members
// exchange are contiguous. Failures throw, as torch ops do; the executable turns them back into
// the collective's Status. What the runtime allocates for a call (its group's placement, the
// meeting, the messages, a scratch buffer the size of the call's data, which the device already
// holds) is its own, not the body's: it runs with the body's heap paused (compute/body_heap.h),
// and the output is made outside the pause.

collective::ShardCollectives& CurrentShard() {
  collective::ShardCollectives* shard = collective::ShardCollectives::Current();
  PW_OP_CHECK(shard != nullptr, "pathways collectives run only inside a compiled function running on a slice");
  return *shard;
}

int GroupSize(const std::string& axes) {
  const BodyHeapPause runtime;
  auto size = CurrentShard().GroupSize(axes);
  PW_OP_CHECK(size.ok(), size.status().ToString());
  return *size;
}

// Runs `kind` with `x` (contiguous) as input and `out` as output. Collectives that only move
// data take any element type, as bytes; reductions need one the runtime can add.
void RunCollective(collective::CollectiveKind kind, const std::string& axes, const at::Tensor& x, at::Tensor& out,
                   collective::ReduceOp op = collective::ReduceOp::kSum, int root = 0, int64_t shift = 0) {
  const bool reduces =
      kind == collective::CollectiveKind::kAllReduce || kind == collective::CollectiveKind::kReduceScatter;
  DType dtype = FromTorch(x.scalar_type());
  size_t count = static_cast<size_t>(x.numel());
  if (!reduces) {
    dtype = DType::kBool;  // one byte per element
    count = x.nbytes();
  }
  PW_OP_CHECK(dtype != DType::kInvalid, collective::CollectiveName(kind), ": cannot reduce tensors of type ",
              x.scalar_type());
  collective::CollectiveCall call;
  call.kind = kind;
  call.dtype = dtype;
  call.op = op;
  call.root = root;
  call.shift = shift;
  call.count = count;
  call.in = static_cast<const char*>(x.data_ptr());
  call.out = static_cast<char*>(out.data_ptr());
  absl::Status s;
  {
    const BodyHeapPause runtime;
    s = CurrentShard().Run(axes, call);
  }
  TORCH_CHECK(s.ok(), s.ToString());  // the run fails with the collective's own code (its first error)
}

void CheckDim(const at::Tensor& x, int64_t dim, const char* what) {
  PW_OP_CHECK(dim >= 0 && dim < x.dim(), what, ": dimension ", dim, " is not in a tensor of rank ", x.dim());
}

void CheckSplits(const at::Tensor& x, int64_t dim, int members, const char* what) {
  CheckDim(x, dim, what);
  PW_OP_CHECK(x.size(dim) % members == 0, what, ": dimension ", dim, " of size ", x.size(dim),
              " does not split into ", members, " equal chunks");
}

// Whether a collective may write its result over `x`: torch allocated the storage inside the body
// (it is no view of an input's device buffer, which other runs may read), `x` spans all of it,
// and nothing else refers to the tensor or its storage. TorchScript's interpreter moves a value
// into the op that uses it last, so a temporary (`all_reduce(x * 2)`, a loop-carried value)
// arrives with the only reference, and its bytes are reduced where they are instead of into a
// fresh buffer: one less buffer written per call.
bool Overwritable(const at::Tensor& x) {
  return x.defined() && !x.requires_grad() && x.is_contiguous() && x.use_count() == 1 && x.has_storage() &&
         x.storage().use_count() == 1 && x.storage_offset() == 0 &&
         x.nbytes() == x.storage().nbytes() &&
         x.storage().data_ptr().get_deleter() == c10::GetCPUAllocator()->raw_deleter();
}

at::Tensor AllReduceRaw(const at::Tensor& x, const std::string& axes, const std::string& op) {
  const bool mean = op == "mean";
  PW_OP_CHECK(!mean || at::isFloatingType(x.scalar_type()), "all_reduce 'mean' needs a floating-point tensor");
  auto reduce = collective::ParseReduceOp(mean ? "sum" : op);
  PW_OP_CHECK(reduce.ok(), reduce.status().message());
  if (Overwritable(x)) {
    at::Tensor inout = x;
    RunCollective(collective::CollectiveKind::kAllReduce, axes, inout, inout, *reduce);
    if (mean) inout.div_(GroupSize(axes));
    return inout;
  }
  at::Tensor in = x.contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kAllReduce, axes, in, out, *reduce);
  if (mean) out.div_(GroupSize(axes));
  return out;
}

at::Tensor AllGatherRaw(const at::Tensor& x, const std::string& axes, int64_t dim) {
  CheckDim(x, dim, "all_gather");
  const int members = GroupSize(axes);
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] *= members;
  at::Tensor out = torch::empty(sizes, in.options());
  RunCollective(collective::CollectiveKind::kAllGather, axes, in, out);
  return out.movedim(0, dim);
}

at::Tensor ReduceScatterRaw(const at::Tensor& x, const std::string& axes, const std::string& op, int64_t dim) {
  auto reduce = collective::ParseReduceOp(op);
  PW_OP_CHECK(reduce.ok(), reduce.status().message());
  const int members = GroupSize(axes);
  CheckSplits(x, dim, members, "reduce_scatter");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> sizes = in.sizes().vec();
  sizes[0] /= members;
  at::Tensor out = torch::empty(sizes, in.options());
  RunCollective(collective::CollectiveKind::kReduceScatter, axes, in, out, *reduce);
  return out.movedim(0, dim);
}

// Chunk j of member i's tensor goes to member j, which concatenates its chunks in member order.
at::Tensor AllToAllRaw(const at::Tensor& x, const std::string& axes, int64_t dim) {
  CheckSplits(x, dim, GroupSize(axes), "all_to_all");
  at::Tensor in = x.movedim(dim, 0).contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kAllToAll, axes, in, out);
  return out.movedim(0, dim);
}

at::Tensor BroadcastRaw(const at::Tensor& x, const std::string& axes, int64_t root) {
  const int members = GroupSize(axes);
  PW_OP_CHECK(root >= 0 && root < members, "broadcast: root ", root, " is not a member of a group of ", members);
  at::Tensor in = x.contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kBroadcast, axes, in, out, collective::ReduceOp::kSum,
                static_cast<int>(root));
  return out;
}

// Member r gets member (r - shift)'s x, as torch.roll moves elements along the group. The shift
// is taken modulo the group's size, so that its transpose (-shift) cannot overflow.
at::Tensor RollRaw(const at::Tensor& x, const std::string& axes, int64_t shift) {
  const int64_t members = GroupSize(axes);
  shift = (shift % members + members) % members;
  at::Tensor in = x.contiguous();
  at::Tensor out = torch::empty_like(in);
  RunCollective(collective::CollectiveKind::kRoll, axes, in, out, collective::ReduceOp::kSum, 0, shift);
  return out;
}

// Gradients of the collectives (their transposes), for bodies differentiated by a gradient body.
// A value replicated over a group carries, per shard, a part of its cotangent: the cotangent of
// the global value is the sum of the parts (see FunctionBody::Gradient). So all_reduce(sum)
// transposes to all_reduce(sum), all_gather to reduce_scatter(sum) and back, all_to_all to
// itself, roll by s to roll by -s, and broadcast to a sum that lands on the root.
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct AllReduceGrad : torch::autograd::Function<AllReduceGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, const std::string& op) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["op"] = op;
    return AllReduceRaw(x, axes, op);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    TORCH_CHECK(op == "sum" || op == "mean", "all_reduce '", op, "' has no gradient (only 'sum' and 'mean' do)");
    return {AllReduceRaw(g[0], ctx->saved_data["axes"].toStringRef(), op), at::Tensor(), at::Tensor()};
  }
};

struct AllGatherGrad : torch::autograd::Function<AllGatherGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t dim) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["dim"] = dim;
    return AllGatherRaw(x, axes, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    return {ReduceScatterRaw(g[0], ctx->saved_data["axes"].toStringRef(), "sum", ctx->saved_data["dim"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterGrad : torch::autograd::Function<ReduceScatterGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, const std::string& op,
                            int64_t dim) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["op"] = op;
    ctx->saved_data["dim"] = dim;
    return ReduceScatterRaw(x, axes, op, dim);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    TORCH_CHECK(op == "sum", "reduce_scatter '", op, "' has no gradient (only 'sum' does)");
    return {AllGatherRaw(g[0], ctx->saved_data["axes"].toStringRef(), ctx->saved_data["dim"].toInt()), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// A permutation of the group's data with one integer argument, whose transpose is the same op
// with the argument times `kSign`: all_to_all (its own transpose, along the same dimension) and
// roll (the transpose of a shift is the opposite shift).
template <at::Tensor (*Op)(const at::Tensor&, const std::string&, int64_t), int64_t kSign>
struct PermutationGrad : torch::autograd::Function<PermutationGrad<Op, kSign>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t arg) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["arg"] = arg;
    return Op(x, axes, arg);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    return {Op(g[0], ctx->saved_data["axes"].toStringRef(), kSign * ctx->saved_data["arg"].toInt()), at::Tensor(),
            at::Tensor()};
  }
};
using AllToAllGrad = PermutationGrad<AllToAllRaw, 1>;
using RollGrad = PermutationGrad<RollRaw, -1>;

struct BroadcastGrad : torch::autograd::Function<BroadcastGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& axes, int64_t root) {
    ctx->saved_data["axes"] = axes;
    ctx->saved_data["root"] = root;
    return BroadcastRaw(x, axes, root);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    const std::string axes = ctx->saved_data["axes"].toStringRef();
    at::Tensor sum = AllReduceRaw(g[0], axes, "sum");
    auto group = CurrentShard().GroupOver(axes);
    TORCH_CHECK(group.ok(), group.status().ToString());
    if (group->rank != ctx->saved_data["root"].toInt()) sum.zero_();
    return {sum, at::Tensor(), at::Tensor()};
  }
};

// Outside differentiation an op skips autograd's wrapper: its node is made (and freed) whether or
// not anything records it, a few microseconds a call, and it holds a second reference to `x`,
// which would keep all_reduce from reducing in place.
template <typename Grad, typename Raw, typename... Args>
at::Tensor Recorded(Raw raw, const at::Tensor& x, const Args&... args) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return raw(x, args...);
  return Grad::apply(x, args...);
}

at::Tensor Roll(const at::Tensor& x, std::string axes, int64_t shift) {
  return Recorded<RollGrad>(RollRaw, x, axes, shift);
}

// This shard's position along `axes` (row-major over several, as the collectives order their
// members): what a body needs to find its neighbours, as JAX's axis_index.
int64_t AxisIndex(std::string axes) {
  auto group = CurrentShard().GroupOver(axes);
  PW_OP_CHECK(group.ok(), "axis_index: ", group.status().message());
  return group->rank;
}

}  // namespace

at::Tensor AllReduceOp(const at::Tensor& x, std::string axes, std::string op) {
  return Recorded<AllReduceGrad>(AllReduceRaw, x, axes, op);
}
at::Tensor AllGatherOp(const at::Tensor& x, std::string axes, int64_t dim) {
  return Recorded<AllGatherGrad>(AllGatherRaw, x, axes, dim);
}
at::Tensor ReduceScatterOp(const at::Tensor& x, std::string axes, std::string op, int64_t dim) {
  return Recorded<ReduceScatterGrad>(ReduceScatterRaw, x, axes, op, dim);
}
at::Tensor AllToAllOp(const at::Tensor& x, std::string axes, int64_t dim) {
  return Recorded<AllToAllGrad>(AllToAllRaw, x, axes, dim);
}
at::Tensor BroadcastOp(const at::Tensor& x, std::string axes, int64_t root) {
  return Recorded<BroadcastGrad>(BroadcastRaw, x, axes, root);
}

int ShardGroupSize(const std::string& axes) { return GroupSize(axes); }

at::Tensor AllReduceNoGrad(const at::Tensor& x, const std::string& axes, const std::string& op) {
  return AllReduceRaw(x, axes, op);
}

// Registered with the other pathways ops (torch_ops.cc), with the same conservative alias analysis.
TORCH_LIBRARY_FRAGMENT(pathways, m) {
  auto op = [](const char* schema) { return torch::schema(schema, c10::AliasAnalysisKind::CONSERVATIVE); };
  m.def(op("all_reduce(Tensor x, str axes='', str op='sum') -> Tensor"), &AllReduceOp);
  m.def(op("all_gather(Tensor x, str axes='', int dim=0) -> Tensor"), &AllGatherOp);
  m.def(op("reduce_scatter(Tensor x, str axes='', str op='sum', int dim=0) -> Tensor"), &ReduceScatterOp);
  m.def(op("all_to_all(Tensor x, str axes='', int dim=0) -> Tensor"), &AllToAllOp);
  m.def(op("broadcast(Tensor x, str axes='', int root=0) -> Tensor"), &BroadcastOp);
  m.def(op("roll(Tensor x, str axes='', int shift=1) -> Tensor"), &Roll);
  m.def(op("axis_index(str axes='') -> int"), &AxisIndex);
}

}  // namespace pathways
