// What every benchmark program measures with: medians of repeated runs and wall time.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

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

}  // namespace pathways::bench
