// `pathways tenant`: one client job against a running cluster, for multi-tenancy.
#pragma once

#include "absl/status/status.h"
#include "tools/flags.h"

namespace pathways {

// Connects to --controller, runs a gang program (a scaled all_reduce over a slice of --devices
// devices) --runs times with up to 8 runs in flight, and checks every result. --value makes this
// tenant's data its own; --weight is its share under proportional share; --trace FILE writes its
// device trace.
absl::Status RunTenant(const Flags& flags);

}  // namespace pathways
