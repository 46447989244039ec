// Process-wide settings for programs that serve or measure (the `pathways` tool, benchmarks).
#pragma once

namespace pathways {

// Call first thing in main(). Turns off Abseil's Mutex deadlock detection: the Debian build of
// Abseil keeps it on, so every lock and unlock updates one process-wide lock-order graph behind a
// global spinlock, which cost about a tenth of the CPU of a busy embedded cluster and serialised
// all its threads. Tests leave it on, to catch lock-order inversions. Also keeps freed memory of
// kernels' outputs for the next call instead of returning it to the kernel at once, and raises
// the descriptor limit and keeps servers accepting once descriptors run out (see .cc).
void InitServingProcess();

}  // namespace pathways
