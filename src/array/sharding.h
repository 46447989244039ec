// How a logical array is laid over a slice's device mesh, and the region arithmetic that
// resharding and host-to-host transfers are built from. Pure metadata; no devices, no torch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/types.h"

namespace pathways {

// A logical device mesh: its extent per axis and the axis names. Devices are numbered
// row-major over the mesh; device i of a slice holds shard i of every array on that slice.
struct Mesh {
  std::vector<int64_t> dims;
  std::vector<std::string> axis_names;

  // Validates: 1 to 3 axes, positive extents, distinct non-empty names, at most `max_devices`.
  static absl::StatusOr<Mesh> Create(std::vector<int64_t> dims,
                                     std::vector<std::string> axis_names = {},
                                     int64_t max_devices = 1 << 20);
  int64_t num_devices() const;
  // -1 when there is no axis of that name.
  int AxisIndex(const std::string& name) const;
  std::vector<int64_t> Coordinates(int64_t device_index) const;
  std::string ToString() const;
  bool operator==(const Mesh&) const = default;
};

// Per array dimension, the mesh axes that split it: "" (not split), one axis name, or several
// joined by commas ("x,y": the dimension is cut into |x|*|y| blocks, the first axis major, in
// the order a collective over "x,y" ranks its members). Mesh axes that split no dimension
// replicate the array along them.
using PartitionSpec = std::vector<std::string>;
std::string PartitionSpecToString(const PartitionSpec& spec);
// The axis names of one entry of a spec (none for "").
std::vector<std::string> SpecAxes(const std::string& entry);

// A hyper-rectangle inside an array: per-dimension start and size.
struct Region {
  Shape start;
  Shape size;
  bool operator==(const Region&) const = default;
  std::string ToString() const;
};
std::optional<Region> Intersect(const Region& a, const Region& b);

// An array's global shape laid over a mesh by a PartitionSpec. Immutable; built by Create, which
// validates that every split dimension divides evenly.
class Sharding {
 public:
  static absl::StatusOr<Sharding> Create(const Mesh& mesh, const PartitionSpec& spec,
                                         const Shape& global_shape);
  const Mesh& mesh() const { return mesh_; }
  const PartitionSpec& spec() const { return spec_; }
  const Shape& global_shape() const { return global_shape_; }
  const Shape& local_shape() const { return local_shape_; }
  int64_t num_shards() const { return mesh_.num_devices(); }
  // The part of the global array that shard `index` (= device index in the mesh) holds.
  Region ShardRegion(int64_t index) const;
  bool operator==(const Sharding&) const = default;

 private:
  Mesh mesh_;
  PartitionSpec spec_;
  Shape global_shape_;
  Shape local_shape_;
};

// Copies `size` elements' worth of region from a dense row-major source array to a dense
// row-major destination array. Regions must lie inside their arrays (checked by the callers).
void CopyRegion(const char* src, const Shape& src_shape, const Shape& src_start, const Shape& size,
                size_t element_size, char* dst, const Shape& dst_shape, const Shape& dst_start);

// When `region` (inside an array of `shape`) is one contiguous run of the row-major array: its
// first element's offset and its element count. A region is contiguous when every dimension
// after the last partial one is whole and every dimension before it has size 1.
std::optional<std::pair<int64_t, int64_t>> ContiguousSpan(const Shape& shape, const Region& region);

// Validates that `region` lies inside an array of `shape`.
absl::Status CheckRegionInside(const Region& region, const Shape& shape);

}  // namespace pathways
