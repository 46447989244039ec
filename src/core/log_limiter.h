// A log line that may repeat fast (a loop over a lost host fails every run): said at most once
// per interval, with how many occurrences went unsaid since the last one said.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pathways {

// Not thread-safe: the caller holds its own lock around Say and Unsaid.
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration every) : every_(every) {}

  // Counts `n` occurrences; true when the line is to be said now.
  bool Say(int64_t n = 1) {
    const absl::Time now = absl::Now();
    if (now < next_) {
      unsaid_ += n;
      return false;
    }
    said_after_ = unsaid_;
    unsaid_ = 0;
    next_ = now + every_;
    return true;
  }
  // For the line being said: " (N <what>)", N the occurrences left unsaid before it; "" for none.
  std::string Unsaid(absl::string_view what) const {
    return said_after_ > 0 ? absl::StrCat(" (", said_after_, " ", what, ")") : "";
  }

 private:
  const absl::Duration every_;
  absl::Time next_ = absl::InfinitePast();
  int64_t unsaid_ = 0;
  int64_t said_after_ = 0;
};

}  // namespace pathways
