#pragma once

#include "absl/status/status.h"
#include "tools/flags.h"

namespace pathways {

// `pathways demo`: a sharded computation on an embedded two-island cluster, with what ran where
// and a check of the result against libtorch run locally.
absl::Status RunDemo(const Flags& flags);

}  // namespace pathways
