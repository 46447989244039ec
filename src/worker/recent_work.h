// A device's recent work as the controller's dashboard draws it: the trace ring's events since
// the last heartbeat, as device time per client in buckets of fixed width aligned to the clock.
// However many computations a device runs, a heartbeat carries a bounded number of buckets, and
// the dashboard a bounded number of bars.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "device/device.h"
#include "proto/pathways.pb.h"

namespace pathways {

// The width of a bucket, and how many a heartbeat carries per device at most (the newest).
inline constexpr int64_t kWorkBucketUs = 100'000;
inline constexpr size_t kMaxBucketsPerHeartbeat = 128;

// The device time of `events` that ended after `after_us`, per bucket [k * width, (k+1) * width)
// and client (labelled with the first 8 digits of its id), an event split over the buckets it
// spans. Buckets in time order, each of its clients once; buckets without work are left out.
// A later call may add to a bucket an earlier one reported (work that ended since): the
// controller adds buckets of the same start together (ClusterRegistry). The caller remembers
// the latest end it passed on as `after_us`; work of a heartbeat that fails is not sent again,
// and a wall clock stepped back hides new work until it passes that end again (the dashboard's
// loss only: counters and shares come from the devices' own totals).
std::vector<rpc::WorkBucket> RecentWork(const std::vector<TraceEvent>& events, int64_t after_us,
                                        int64_t width_us = kWorkBucketUs,
                                        size_t max_buckets = kMaxBucketsPerHeartbeat);

}  // namespace pathways
