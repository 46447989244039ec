// Which blocks of a source layout make up one shard of a destination layout. Hosts use this to
// wire a computation's inputs and to decide what to send where, each computing the same answer
// independently, so no per-shard plan ever travels from the client.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "array/sharding.h"
#include "core/ids.h"

namespace pathways {

// Where one device of a slice lives.
struct DeviceLocation {
  DeviceId device_id{-1};
  std::string host;  // the worker's address
};

// An array's layout: a sharding and the devices holding its shards (device i holds shard i).
struct Placement {
  const Sharding* sharding;                        // not owned
  const std::vector<DeviceLocation>* devices;      // not owned; one per shard
};

// One block of a destination shard, read from one source shard.
struct Piece {
  int64_t src_shard;
  Region src_region;  // in the source shard's local coordinates
  Shape dst_start;    // where it lands in the destination shard
};

// The pieces of destination shard `dst_shard`, one per distinct source block overlapping it.
// Among replicas of a block it reads the one on the destination's own device, else one on the
// destination's host, else the lowest-numbered shard: a deterministic choice, so the host that
// sends and the host that receives agree without talking. Cost grows with the pieces and the
// replicas of each, not with the total number of shards.
std::vector<Piece> PlanShard(const Placement& src, const Placement& dst, int64_t dst_shard);

}  // namespace pathways
