// Requests for tests of the cluster registry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "proto/pathways.pb.h"

namespace pathways::testing {

// A worker at `address` in `island` with `devices` devices of 1 MiB.
inline rpc::RegisterWorkerRequest Worker(const std::string& address, int island, int devices) {
  rpc::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_island(island);
  for (int i = 0; i < devices; ++i) r.add_devices()->set_memory_capacity(1 << 20);
  return r;
}

inline rpc::AllocateSliceRequest Slice(std::vector<int64_t> mesh, int island = -1) {
  rpc::AllocateSliceRequest r;
  for (int64_t d : mesh) r.add_mesh_shape(d);
  if (island >= 0) {
    r.set_has_island(true);
    r.set_island(island);
  }
  return r;
}

}  // namespace pathways::testing
