#include "core/process.h"

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/executor.h"
#include "core/logging.h"

namespace pathways {
namespace {

// A descriptor held back for the moment the process runs out: closing it makes room to accept
// and close a pending connection (see accept4 below).
std::atomic<bool> guard_on{false};  // from InitServingProcess on
int spare_descriptor = -1;
absl::Mutex& spare_mu = *new absl::Mutex;  // never destroyed: accepts go on while the process exits
std::atomic<int64_t> last_warning_ns{0};

int RawAccept4(int fd, sockaddr* addr, socklen_t* length, int flags) {
  return static_cast<int>(syscall(SYS_accept4, fd, addr, length, flags));
}

// The connections each listener accepted, to cap them (SetConnectionsPerListener). A descriptor
// is known by its number and its inode: once the connection is closed, the number is either free
// or names another file, so counting needs no hook on close(). Pruned only when a listener reaches
// its cap, so an accept below it costs one insertion.
struct AcceptedConnections {
  ino_t listener_inode = 0;
  absl::flat_hash_map<int, ino_t> open;  // descriptor -> its inode when accepted
  int64_t next_prune_ns = 0;
};
std::atomic<int> connection_cap{0};  // 0: no cap
absl::Mutex& accepted_mu = *new absl::Mutex;  // never destroyed, as spare_mu
std::unordered_map<int, AcceptedConnections>* accepted ABSL_GUARDED_BY(accepted_mu) =
    new std::unordered_map<int, AcceptedConnections>();
std::atomic<int64_t> last_cap_warning_ns{0};

ino_t InodeOf(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

// Warns at most once per 10 s per kind: a flood must not flood the log too.
bool TimeToWarn(std::atomic<int64_t>& last) {
  const int64_t now = absl::GetCurrentTimeNanos();
  int64_t then = last.load(std::memory_order_relaxed);
  return now - then > int64_t{10'000'000'000} && last.compare_exchange_strong(then, now, std::memory_order_relaxed);
}

// Whether the listener may keep the connection it just accepted; records it if so.
bool AdmitConnection(int listener, int connection) {
  const int cap = connection_cap.load(std::memory_order_relaxed);
  if (cap <= 0) return true;
  const ino_t listener_inode = InodeOf(listener);
  const ino_t connection_inode = InodeOf(connection);
  absl::MutexLock lock(&accepted_mu);
  AcceptedConnections& mine = (*accepted)[listener];
  if (mine.listener_inode != listener_inode) mine = AcceptedConnections{listener_inode, {}, 0};  // a new listener
  // At the cap, closed ones are pruned: at most every 20 ms, and no sooner than ten times the
  // last pruning took, so a flood that holds the cap costs the process at most a tenth of a core
  // (and the other listeners, which share the lock, at most as much).
  const int64_t now = absl::GetCurrentTimeNanos();
  if (static_cast<int>(mine.open.size()) >= cap && now >= mine.next_prune_ns) {
    for (auto it = mine.open.begin(); it != mine.open.end();) {
      if (InodeOf(it->first) != it->second) {
        mine.open.erase(it++);
      } else {
        ++it;
      }
    }
    const int64_t took = absl::GetCurrentTimeNanos() - now;
    mine.next_prune_ns = now + std::max<int64_t>(20'000'000, 10 * took);
  }
  // The number may still be listed from a connection that closed before the last pruning.
  auto listed = mine.open.find(connection);
  if (listed != mine.open.end()) {
    listed->second = connection_inode;
    return true;
  }
  if (static_cast<int>(mine.open.size()) >= cap) return false;
  mine.open.emplace(connection, connection_inode);
  return true;
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
//
// The same definition caps the connections each listener holds (SetConnectionsPerListener): one
// accepted beyond the cap is closed at once, and the caller hears ECONNABORTED.
extern "C" int accept4(int fd, sockaddr* __restrict addr, socklen_t* __restrict length, int flags) {
  using pathways::RawAccept4;
  const socklen_t given = length != nullptr ? *length : 0;
  int accepted = RawAccept4(fd, addr, length, flags);
  const int error = errno;
  if (accepted >= 0) {
    if (!pathways::guard_on) return accepted;
    // Only non-blocking listeners (a blocking one would wait in the loop below).
    const int listener_flags = fcntl(fd, F_GETFL);
    if (listener_flags < 0 || (listener_flags & O_NONBLOCK) == 0) return accepted;
    // Beyond the cap, every queued connection is closed (bounded): listeners wait for the next
    // edge of readiness, so one left queued would sit behind the next arrival.
    int refused = 0;
    while (!pathways::AdmitConnection(fd, accepted)) {
      close(accepted);
      if (++refused == 1024) break;
      if (length != nullptr) *length = given;
      accepted = RawAccept4(fd, addr, length, flags);
      if (accepted < 0) break;
    }
    const int last_error = errno;
    if (refused > 0 && pathways::TimeToWarn(pathways::last_cap_warning_ns)) {
      PW_LOG(Warning) << "a listener holds its cap of " << pathways::connection_cap.load() << " connections: closed "
                      << refused << " new one(s) unserved; new ones are served again once others close";
    }
    if (refused == 0 || (accepted >= 0 && refused < 1024)) return accepted;
    // The queue is empty (EAGAIN, as the caller expects), or not yet: ECONNABORTED keeps the
    // caller accepting.
    errno = accepted < 0 && (last_error == EAGAIN || last_error == EWOULDBLOCK) ? last_error : ECONNABORTED;
    return -1;
  }
  if (error != EMFILE && error != ENFILE) return accepted;
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
      if (length != nullptr) *length = given;
      accepted = RawAccept4(fd, addr, length, flags);
      if (accepted >= 0) {  // descriptors are free again
        if (pathways::AdmitConnection(fd, accepted)) return accepted;
        close(accepted);
        ++dropped;
        break;
      }
      if (errno != EMFILE && errno != ENFILE) break;
    }
  }
  if (pathways::TimeToWarn(pathways::last_warning_ns)) {
    PW_LOG(Warning) << "out of descriptors: closed " << dropped
                    << " incoming connection(s) unserved; new ones are served again once others close";
  }
  // Even when nothing could be dropped (another thread took the spare's slot): EMFILE would stop
  // gRPC's listener for good; the connection stays queued for the next try.
  errno = ECONNABORTED;
  return -1;
}

// tcmalloc's, where the process allocates through it.
extern "C" void MallocExtension_ReleaseFreeMemory() __attribute__((weak));
extern "C" int MallocExtension_GetNumericProperty(const char* property, size_t* value) __attribute__((weak));

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
  // Under tcmalloc (executables link it: CMakeLists.txt), mallopt does nothing and what its
  // page heap holds free goes back the same way, through its own call: a worker of memory_bench
  // settled at 437 MiB with it against 528 without, and training ran as fast either way
  // (2026-12-04, three pairs of runs).
  // What tcmalloc's page heap may keep free without giving it back.
  constexpr size_t kKeptFreeBytes = 32 << 20;
  static const bool trimming = [] {
    // It serves no one, so it takes no SIGINT or SIGTERM: a serving process's goes to the thread
    // that waits for it (tools/pathways_main.cc). Blocked around its start, so it never runs
    // without the mask.
    const sigset_t stop = TerminationSignals();
    sigset_t before;
    pthread_sigmask(SIG_BLOCK, &stop, &before);
    std::thread([] {
      NameThisThread("release-memory");
      while (true) {
        absl::SleepFor(absl::Seconds(1));
        if (MallocExtension_ReleaseFreeMemory != nullptr) {
          // Only a page heap that holds much free: a busy process whose heap churns a few MiB
          // would otherwise hand the same pages back every second and fault them in again (a
          // client in opbyop_bench spent 8 us of CPU per round trip on this thread alone).
          size_t free_bytes = 0;
          if (MallocExtension_GetNumericProperty == nullptr ||
              !MallocExtension_GetNumericProperty("tcmalloc.pageheap_free_bytes", &free_bytes) ||
              free_bytes >= kKeptFreeBytes) {
            MallocExtension_ReleaseFreeMemory();
          }
        } else {
          malloc_trim(0);
        }
      }
    }).detach();
    pthread_sigmask(SIG_SETMASK, &before, nullptr);
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
  // A listener holds at most a quarter of the descriptors (a worker has three listeners: RPCs,
  // collective links, data streams), so floods of connections to its ports leave the process
  // descriptors for its own links and files.
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 && connection_cap.load() == 0) {
    const rlim_t quarter = files.rlim_cur == RLIM_INFINITY ? kDefaultMaxConnections : files.rlim_cur / 4;
    connection_cap = static_cast<int>(std::clamp<rlim_t>(quarter, 16, kDefaultMaxConnections));
  }
  absl::MutexLock lock(&spare_mu);
  guard_on = true;
  if (spare_descriptor < 0) spare_descriptor = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

absl::Status SetConnectionsPerListener(int64_t max) {
  if (max < 1 || max > kMaxConnectionsPerListener) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections per listener must be 1..", kMaxConnectionsPerListener, ", got ", max));
  }
  connection_cap = static_cast<int>(max);
  return absl::OkStatus();
}

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

int ConnectionsPerListener() { return connection_cap.load(); }

}  // namespace pathways
