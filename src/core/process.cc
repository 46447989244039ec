#include "core/process.h"

#include <malloc.h>
#include <sys/resource.h>

#include "absl/synchronization/mutex.h"

namespace pathways {

void InitServingProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Kernels allocate their outputs afresh at every call. Allocations of 1 MiB and more go through
  // HostMemory's cache (device/host_memory.h); smaller ones come from the heap instead of a
  // fresh mapping each (glibc's threshold would otherwise stay at 128 KiB once the trim
  // threshold is set), and freed heap memory up to the trim threshold stays in the process for
  // the next call instead of being faulted in again.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // Connections are descriptors: take every one the system allows this process (the soft limit
  // is often far below the hard one), so a burst of connections does not run a server out.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
}

}  // namespace pathways
