// Process-wide settings for programs that serve or measure (the `pathways` tool, benchmarks).
#pragma once

#include <signal.h>

#include <cstdint>

#include "absl/status/status.h"

namespace pathways {

// Call first thing in main(). Turns off Abseil's Mutex deadlock detection: the Debian build of
// Abseil keeps it on, so every lock and unlock updates one process-wide lock-order graph behind a
// global spinlock, which cost about a tenth of the CPU of a busy embedded cluster and serialised
// all its threads. Tests leave it on, to catch lock-order inversions. Also keeps freed memory of
// kernels' outputs for the next call instead of returning it to the kernel at once, and raises
// the descriptor limit and keeps servers accepting once descriptors run out (see .cc).
void InitServingProcess();

// Connections are a bounded resource: each listening socket of a serving process (RPC servers,
// collective and block listeners) holds at most this many accepted connections; one beyond is
// closed as soon as it is accepted (its client sees the connection closed and may retry), until
// others close. InitServingProcess sets a quarter of the descriptor limit, at most
// kDefaultMaxConnections; servers' idle and half-open connections are closed after a timeout,
// which frees places. Only non-blocking listeners are capped.
inline constexpr int64_t kMaxConnectionsPerListener = 1 << 20;
inline constexpr int64_t kDefaultMaxConnections = 65536;
absl::Status SetConnectionsPerListener(int64_t max);
int ConnectionsPerListener();

// SIGINT and SIGTERM: what stops a serving process. Threads that serve no one block them.
sigset_t TerminationSignals();

}  // namespace pathways
