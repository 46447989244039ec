#include "core/process.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace pathways {

void InitServingProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Kernels allocate their outputs afresh at every call (a 4 MiB all_reduce allocates 4 MiB, its
  // add another 4 MiB). glibc serves such sizes with fresh mmaps, or trims freed arena memory
  // straight back, so every call page-faults its outputs in again: measured with
  // bench/collective_bench, a 4 MiB all_reduce step between two workers ran at 134 steps/s with
  // the defaults and 240 with these. Freed memory up to the trim threshold stays in the process
  // for the next call instead.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace pathways
