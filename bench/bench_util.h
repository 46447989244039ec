// What every benchmark program measures with: medians of repeated runs and wall time.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "tools/flags.h"

namespace pathways::bench {

// The median of `v` (the upper one of an even count); 0 for none.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Wall seconds `body` takes.
inline double Seconds(const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The integer flag `name` (or `fallback`), which must be from `min` to `max`: a benchmark given a
// bad one says which and exits with status 2.
inline int64_t IntFlagOrExit(const Flags& flags, const std::string& name, int64_t fallback, int64_t min = 1,
                             int64_t max = int64_t{1} << 30) {
  absl::StatusOr<int64_t> value = flags.GetInt(name, fallback);
  if (value.ok() && *value >= min && *value <= max) return *value;
  const std::string why = value.ok() ? "must be from " + std::to_string(min) + " to " + std::to_string(max)
                                     : value.status().ToString();
  std::fprintf(stderr, "--%s: %s\n", name.c_str(), why.c_str());
  std::exit(2);
}

}  // namespace pathways::bench
