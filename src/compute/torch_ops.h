// Internal to the compute layer, the only one that includes torch: the `pathways.*` torch ops
// (collectives and their gradients, collective_ops.cc; random numbers, training data,
// torch_ops.cc), the built-in kernels, and what the executables (torch_executable.cc) and the
// allocator (torch_allocator.cc) share.
#pragma once

// ivalue.h first: clang (C++20) otherwise instantiates List<IValue> members while IValue is
// still incomplete inside <torch/torch.h> and fails (GCC does not).
#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/types.h"

namespace pathways {

absl::StatusOr<at::ScalarType> ToTorch(DType dtype);
// kInvalid for a type the runtime has no dtype for.
DType FromTorch(at::ScalarType t);

// A bad argument of a pathways op: the run fails with InvalidArgument and this message, not as
// an Internal failure of the TorchScript interpreter (the executable reads OpFailure()).
#define PW_OP_CHECK(cond, ...)                                     \
  do {                                                             \
    if (!(cond)) {                                                 \
      const std::string pw_op_message = c10::str(__VA_ARGS__);     \
      OpFailure() = absl::InvalidArgumentError(pw_op_message);     \
      TORCH_CHECK(false, pw_op_message);                           \
    }                                                              \
  } while (0)

// The collective torch ops (collective_ops.cc), differentiable. Each throws on failure.
at::Tensor AllReduceOp(const at::Tensor& x, std::string axes, std::string op);
at::Tensor AllGatherOp(const at::Tensor& x, std::string axes, int64_t dim);
at::Tensor ReduceScatterOp(const at::Tensor& x, std::string axes, std::string op, int64_t dim);
at::Tensor AllToAllOp(const at::Tensor& x, std::string axes, int64_t dim);
at::Tensor BroadcastOp(const at::Tensor& x, std::string axes, int64_t root);
// The number of members of the running shard's group over `axes`. Throws outside a slice.
int ShardGroupSize(const std::string& axes);
// all_reduce ('sum', 'max', 'min' or 'mean') over `axes`, recording no gradient. Throws on failure.
at::Tensor AllReduceNoGrad(const at::Tensor& x, const std::string& axes, const std::string& op);

struct BuiltinKernel {
  int arity;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&, const std::string& axes)> fn;
  bool collective = false;
};
// By name. Collective ones take the mesh axes after an '@' in a body's name ("all_reduce_sum@x,y").
const std::map<std::string, BuiltinKernel>& BuiltinKernels();

// The allocation a kernel on this thread was last refused for want of device memory (OK if
// none): set by the allocator, read and cleared by the executable that ran the kernel. The
// TorchScript interpreter rethrows kernels' exceptions as its own, so their type is lost.
absl::Status& KernelMemoryFailure();
// The same for a `pathways` op that failed with a Status of its own (a data file it may not
// read, say), so the function's error keeps that code.
absl::Status& OpFailure();

// Counts what libtorch allocates on this thread during the scope's life and still holds: what a
// forward pass that keeps its residuals leaves behind. Frees on other threads meanwhile are not
// seen. Scopes nest; an inner one's allocations are not counted by the outer one.
class AllocationScope {
 public:
  AllocationScope();
  ~AllocationScope();
  AllocationScope(const AllocationScope&) = delete;
  AllocationScope& operator=(const AllocationScope&) = delete;
  int64_t live_bytes() const { return live_bytes_; }
  // The bytes of `storage` when this scope allocated it, else 0.
  int64_t BytesOf(const c10::Storage& storage) const;

 private:
  friend class CachingHostAllocator;
  const uint64_t id_;
  int64_t live_bytes_ = 0;
  AllocationScope* const outer_;
};

}  // namespace pathways
