// The controller judges hosts and clients by how long it has not heard from them. When the
// controller itself was away (frozen, or starved of CPU), their messages could not reach it
// meanwhile, so that silence says nothing about them. A loop that runs every fraction of a second
// calls Awake; a judge subtracts Away(now) from the silence it sees, and Awake, on seeing that the
// loop itself was away, returns the gap for the judge to credit for good (each silence is then
// what it was when the controller went away).
#pragma once

#include <algorithm>

#include "absl/time/time.h"

namespace pathways {

class StallCredit {
 public:
  // For silences judged against `timeout`: the loop waking later than a quarter of it (at least
  // 250 ms) after its last wake means the controller was away.
  explicit StallCredit(absl::Duration timeout) : threshold_(std::max(timeout / 4, absl::Milliseconds(250))) {}

  // How long the controller has been away as of `now`: zero unless the loop last woke more than
  // the threshold ago (and zero before the loop's first wake: nothing to judge by).
  absl::Duration Away(absl::Time now) const {
    if (awake_ == absl::InfinitePast() || now - awake_ <= threshold_) return absl::ZeroDuration();
    return now - awake_;
  }
  // The loop woke at `now`: how long the controller was away before it, to credit.
  absl::Duration Awake(absl::Time now) {
    const absl::Duration away = Away(now);
    awake_ = now;
    return away;
  }
  // `last_heard`, credited with an absence `away` that ended at `now`, so that the silence is what
  // it was when the controller went. One heard since it came back needs none: everything is heard
  // either before it went (by the loop's previous wake, or just after) or after it came back, so
  // the middle of the gap tells which.
  static absl::Time Credited(absl::Time last_heard, absl::Time now, absl::Duration away) {
    return last_heard < now - away / 2 ? last_heard + away : last_heard;
  }

 private:
  const absl::Duration threshold_;
  absl::Time awake_ = absl::InfinitePast();
};

}  // namespace pathways
