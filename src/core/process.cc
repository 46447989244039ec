#include "core/process.h"

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/logging.h"

namespace pathways {
namespace {

// A descriptor held back for the moment the process runs out: closing it makes room to accept
// and close a pending connection (see accept4 below).
std::atomic<bool> guard_on{false};  // from InitServingProcess on
int spare_descriptor = -1;
absl::Mutex spare_mu;
std::atomic<int64_t> last_warning_ns{0};

int RawAccept4(int fd, sockaddr* addr, socklen_t* length, int flags) {
  return static_cast<int>(syscall(SYS_accept4, fd, addr, length, flags));
}

}  // namespace
}  // namespace pathways

// Servers keep accepting after running out of descriptors. gRPC 1.51's listener gives up for
// good the first time accept4() fails with EMFILE (it retries only EAGAIN and ECONNABORTED), so a
// burst of connections up to the descriptor limit left a server unreachable after they closed.
// This definition takes the place of libc's for the whole process (the executable's symbols come
// first): while descriptors are out, pending connections are accepted with the spare descriptor
// and closed at once (their clients see the connection closed and retry later), and the caller
// hears ECONNABORTED, which keeps gRPC's listener armed. The usual way servers (nginx, libuv) live
// through EMFILE. Only for non-blocking listeners, after InitServingProcess; otherwise exactly
// libc's call.
extern "C" int accept4(int fd, sockaddr* __restrict addr, socklen_t* __restrict length, int flags) {
  using pathways::RawAccept4;
  int accepted = RawAccept4(fd, addr, length, flags);
  const int error = errno;
  if (accepted >= 0 || (error != EMFILE && error != ENFILE)) return accepted;
  // Only non-blocking listeners: on a blocking one the accept below would wait for a connection
  // (Linux reports EMFILE before it looks at the queue).
  const int listener_flags = fcntl(fd, F_GETFL);
  if (!pathways::guard_on || listener_flags < 0 || (listener_flags & O_NONBLOCK) == 0) {
    errno = error;
    return -1;
  }
  int dropped = 0;
  {
    absl::MutexLock lock(&pathways::spare_mu);
    // The spare is lost when another thread took its slot while it was closed: take it back.
    if (pathways::spare_descriptor < 0) pathways::spare_descriptor = open("/dev/null", O_RDONLY | O_CLOEXEC);
    // Bounded: a flood that goes on is answered again at its next connection.
    for (int i = 0; i < 1024 && pathways::spare_descriptor >= 0; ++i) {
      close(pathways::spare_descriptor);
      const int pending = RawAccept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (pending >= 0) {
        close(pending);
        ++dropped;
      }
      pathways::spare_descriptor = open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (pending < 0) break;  // none left (EAGAIN), or another thread took the spare slot
      accepted = RawAccept4(fd, addr, length, flags);
      if (accepted >= 0) return accepted;  // descriptors are free again
      if (errno != EMFILE && errno != ENFILE) break;
    }
  }
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t last = pathways::last_warning_ns.load(std::memory_order_relaxed);
  if (now - last > int64_t{10'000'000'000} &&
      pathways::last_warning_ns.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    PW_LOG(Warning) << "out of descriptors: closed " << dropped
                    << " incoming connection(s) unserved; new ones are served again once others close";
  }
  // Even when nothing could be dropped (another thread took the spare's slot): EMFILE would stop
  // gRPC's listener for good; the connection stays queued for the next try.
  errno = ECONNABORTED;
  return -1;
}

namespace pathways {

void InitServingProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Kernels allocate their outputs afresh at every call. Allocations of 1 MiB and more go through
  // HostMemory's cache (device/host_memory.h); smaller ones come from the heap instead of a
  // fresh mapping each (glibc's threshold would otherwise stay at 128 KiB once the trim
  // threshold is set), and freed heap memory up to the trim threshold stays in the process for
  // the next call instead of being faulted in again.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  mallopt(M_TRIM_THRESHOLD, 32 << 20);
  // That threshold holds per arena, and threads get arenas of their own (up to 8 per core): free
  // memory of gRPC's received messages, spread over many, stayed in the process. Once a second,
  // what the arenas hold free goes back to the system.
  static const bool trimming = [] {
    std::thread([] {
      while (true) {
        absl::SleepFor(absl::Seconds(1));
        malloc_trim(0);
      }
    }).detach();
    return true;
  }();
  (void)trimming;
  // Connections are descriptors: take every one the system allows this process (the soft limit
  // is often far below the hard one), so a burst of connections does not run a server out.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
  }
  absl::MutexLock lock(&spare_mu);
  guard_on = true;
  if (spare_descriptor < 0) spare_descriptor = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

}  // namespace pathways
