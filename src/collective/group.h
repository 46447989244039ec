// A gang's shape (its mesh and where each shard runs) and the groups its collectives run over:
// the shards that share their coordinates on the mesh axes not named. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/ids.h"

namespace pathways::collective {

// Where one shard of a gang runs: its host and the device's cluster-wide id.
struct Member {
  std::string host;
  DeviceId device{-1};
  friend bool operator==(const Member&, const Member&) = default;
};

// A gang's shape: the mesh of its slice and where each shard runs (shard i at members[i],
// row-major over the mesh). Immutable; built once per program node and shared by its runs.
struct GangLayout {
  std::vector<int64_t> mesh_dims;
  std::vector<std::string> axis_names;
  std::vector<Member> members;
  friend bool operator==(const GangLayout&, const GangLayout&) = default;
};

// The members of one shard's group over some mesh axes.
struct Group {
  std::vector<int64_t> shards;  // in group-rank order: row-major over the named axes, as named
  int rank = 0;                 // the calling shard's rank
  std::string id;               // the coordinates on the other axes, unique within the gang
  std::string label;            // for people: "over [x] at y=2 (2 members)"
};

// `axes` as one spelling: its names without the spaces around them, joined by commas ("" for
// none). Caches keyed by axes use it, so a body cannot grow them by respelling the same group.
std::string CanonicalAxes(absl::string_view axes);

// The group of `shard` over `axes`: comma-separated axis names; empty means every axis.
// InvalidArgument for an unknown or repeated axis name.
absl::StatusOr<Group> GroupOf(const GangLayout& layout, int64_t shard, absl::string_view axes);

// A group and where its members are, seen from one host: worked out once per group and reused by
// every call on it (a fused loop makes many).
struct GroupPlacement {
  Group group;
  std::vector<std::string> hosts;  // the group's hosts in the order every host uses (sorted)
  std::vector<int> host_of;        // index in `hosts` of each group rank's host
  int mine = -1;                   // this host's index in `hosts`
  std::vector<int> local;          // group ranks on this host, ascending
  std::string devices;             // names the member devices: the key of their connections
};
absl::StatusOr<GroupPlacement> PlaceGroup(const GangLayout& layout, int64_t shard, absl::string_view axes,
                                          const std::string& host);

}  // namespace pathways::collective
