#include "core/process.h"

#include "absl/synchronization/mutex.h"

namespace pathways {

void InitServingProcess() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace pathways
