// Checks of what a client is asked to compile or put, before anything is sent (the specs
// themselves are in client/client.h).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "client/client.h"

namespace pathways {

// InvalidArgument, prefixed by `what`, when `spec`'s shape or dtype has no valid byte size.
absl::Status CheckTensorSpec(const TensorSpec& spec, const std::string& what);

// InvalidArgument naming the function when its spec does not hold together: no name, a bad
// input or output spec, shardings that do not match the inputs or outputs, donations out of
// range, repeated, or matching no output.
absl::Status ValidateFunctionSpec(const FunctionSpec& spec);

}  // namespace pathways
