// Which ops a TorchScript function body may call. Bodies run inside workers that tenants share, and
// the TorchScript interpreter is no sandbox: an op that trusts its arguments lets one tenant write
// over the worker's memory, and a few ops open files. Torch-free (ops are named as strings), so the
// policy can be read, tested and printed without libtorch.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pathways {

enum class FunctionOps {
  // The default: the ops in VettedOps() only, each of which checks its arguments against its
  // tensors (libtorch 1.13, swept with hostile arguments), plus TorchScript's control flow and the
  // pathways ops. What a shared worker should run.
  kVetted,
  // Every public forward op that no refusal below names: for clusters whose tenants trust each
  // other (a deny-list over a library cannot know every kernel that trusts its arguments).
  kPublic,
};

// "vetted" or "public"; InvalidArgument naming both otherwise.
absl::StatusOr<FunctionOps> ParseFunctionOps(absl::string_view text);
const char* FunctionOpsName(FunctionOps ops);

// Why a body may not call op `ns`::`op` under `ops`; empty when it may. Under both policies: ops
// that reach files, the shared generator's seed, the worker's log or other processes, aten's
// internal ops (`_`-prefixed, `native_*`, backward kernels) and the public ones known to trust
// their arguments. Under kVetted, also every aten op that VettedOps() does not name.
std::string RefusedOp(absl::string_view ns, absl::string_view op, FunctionOps ops);

// The aten ops kVetted allows, sorted (in-place forms `op_` of an allowed `op` are allowed too).
std::vector<std::string> VettedOps();

}  // namespace pathways
