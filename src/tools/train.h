#pragma once

#include "absl/status/status.h"
#include "tools/flags.h"

namespace pathways {

// `pathways train`: trains the Transformer language model (train/trainer.h) on an embedded cluster,
// or on a running one with --controller, and reports its loss against the data's entropy.
absl::Status RunTrain(const Flags& flags);

}  // namespace pathways
