// The controller judges hosts and clients by how long it has not heard from them. When the
// controller itself was away (frozen, or starved of CPU), their messages could not reach it
// meanwhile, so that silence says nothing about them. A loop that runs every fraction of a second
// calls Awake; a judge subtracts Away(now) from the silence it sees, and Awake, on seeing that the
// loop itself was away, returns the gap for the judge to credit for good (each silence is then
// what it was when the controller went away).
#pragma once

#include "absl/time/time.h"

namespace pathways {

class StallCredit {
 public:
  // The loop waking later than `threshold` after its last wake means the controller was away.
  explicit StallCredit(absl::Duration threshold) : threshold_(threshold) {}

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

 private:
  const absl::Duration threshold_;
  absl::Time awake_ = absl::InfinitePast();
};

}  // namespace pathways
