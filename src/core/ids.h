// Identifiers used across the runtime. Plain integers on the wire; distinct types in C++.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace pathways {

using ArrayId = int64_t;     // one logical ShardedArray, unique within its client
using HostId = int32_t;      // one worker process, assigned by the controller
using DeviceId = int32_t;    // one physical device, cluster-wide, assigned by the controller

// Process-unique, monotonically increasing ids. Thread-safe.
class IdGenerator {
 public:
  explicit IdGenerator(int64_t first = 1) : next_(first) {}
  int64_t Next() { return next_.fetch_add(1, std::memory_order_relaxed); }
  // The first of `n` consecutive ids.
  int64_t Reserve(int64_t n) { return next_.fetch_add(n, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> next_;
};

// A random 64-bit id, for names that must not collide across processes (client ids).
uint64_t RandomId64();
std::string RandomIdString();

}  // namespace pathways
