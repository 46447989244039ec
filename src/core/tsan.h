// Tells ThreadSanitizer about a hand-over it cannot see: one made inside a library that is not
// instrumented (gRPC's core completing a call on another thread). Nothing in other builds.
#pragma once

#if defined(__SANITIZE_THREAD__)
#define PW_TSAN_ENABLED 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PW_TSAN_ENABLED 1
#endif
#endif

#ifdef PW_TSAN_ENABLED
#include <sanitizer/tsan_interface.h>
#endif

namespace pathways {

// Everything written before TsanRelease(p) happens before what follows TsanAcquire(p).
inline void TsanRelease([[maybe_unused]] void* p) {
#ifdef PW_TSAN_ENABLED
  __tsan_release(p);
#endif
}
inline void TsanAcquire([[maybe_unused]] void* p) {
#ifdef PW_TSAN_ENABLED
  __tsan_acquire(p);
#endif
}

}  // namespace pathways
