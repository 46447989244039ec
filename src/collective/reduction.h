// Element-wise reductions over raw buffers, for collectives that reduce in place without a
// tensor library: the cross-host algorithms reduce what arrives from a peer straight into the
// output buffer.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/types.h"

namespace pathways::collective {

enum class ReduceOp { kSum, kMax, kMin };

// "sum", "max" or "min"; InvalidArgument otherwise.
absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view name);
const char* ReduceOpName(ReduceOp op);

// acc[i] = op(acc[i], in[i]) for i < count. Booleans reduce as logical or (sum, max) and and
// (min). Max and min are not commutative for NaN and signed zeros: members that exchange
// partial results apply them in an order they agree on (see cross_host.cc). InvalidArgument for
// an unsupported dtype.
absl::Status ReduceInto(DType dtype, ReduceOp op, void* acc, const void* in, size_t count);
// out[i] = op(a[i], b[i]) for i < count: the first reduction of a call writes its output from two
// inputs, with no copy before it. `out` may be `a` or `b`.
absl::Status Reduce(DType dtype, ReduceOp op, const void* a, const void* b, void* out, size_t count);

}  // namespace pathways::collective
