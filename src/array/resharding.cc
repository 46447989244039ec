#include "array/resharding.h"

namespace pathways {
namespace {

// Per mesh axis of the source: the dimension it splits, or -1 when it replicates.
std::vector<int> AxisToDim(const Sharding& s) {
  std::vector<int> axis_dim(s.mesh().dims.size(), -1);
  for (size_t d = 0; d < s.spec().size(); ++d) {
    for (const std::string& name : SpecAxes(s.spec()[d])) axis_dim[s.mesh().AxisIndex(name)] = static_cast<int>(d);
  }
  return axis_dim;
}

int64_t ShardIndex(const Mesh& mesh, const std::vector<int64_t>& coords) {
  int64_t index = 0;
  for (size_t a = 0; a < coords.size(); ++a) index = index * mesh.dims[a] + coords[a];
  return index;
}

// Advances `coords` over the axes in `axes` (odometer style); false when done.
bool Next(std::vector<int64_t>& coords, const std::vector<int>& axes, const std::vector<int64_t>& lo,
          const std::vector<int64_t>& hi) {
  for (int i = static_cast<int>(axes.size()) - 1; i >= 0; --i) {
    int a = axes[i];
    if (++coords[a] <= hi[a]) return true;
    coords[a] = lo[a];
  }
  return false;
}

}  // namespace

std::vector<Piece> PlanShard(const Placement& src, const Placement& dst, int64_t dst_shard) {
  const Sharding& s = *src.sharding;
  const Mesh& mesh = s.mesh();
  const Region target = dst.sharding->ShardRegion(dst_shard);
  const DeviceLocation& dst_device = (*dst.devices)[dst_shard];
  const std::vector<int> axis_dim = AxisToDim(s);
  const Shape& local = s.local_shape();

  // Ranges of source block coordinates along split axes that overlap the target; replicated
  // axes range over every replica.
  std::vector<int64_t> lo(mesh.dims.size()), hi(mesh.dims.size());
  std::vector<int> split_axes, replica_axes;
  for (size_t a = 0; a < mesh.dims.size(); ++a) {
    int d = axis_dim[a];
    if (d < 0) {
      lo[a] = 0;
      hi[a] = mesh.dims[a] - 1;
      replica_axes.push_back(static_cast<int>(a));
      continue;
    }
    if (target.size[d] == 0) return {};
    split_axes.push_back(static_cast<int>(a));
    if (s.spec()[d].find(',') != std::string::npos) {
      // A dimension split over several axes: every block along them is tried, and those that
      // miss the target are dropped below.
      lo[a] = 0;
      hi[a] = mesh.dims[a] - 1;
      continue;
    }
    lo[a] = target.start[d] / local[d];
    hi[a] = (target.start[d] + target.size[d] - 1) / local[d];
  }

  std::vector<Piece> pieces;
  std::vector<int64_t> block = lo;
  do {
    // The best replica of this block.
    std::vector<int64_t> coords = block;
    for (int a : replica_axes) coords[a] = lo[a];
    int64_t best = -1;
    int best_score = -1;
    do {
      int64_t shard = ShardIndex(mesh, coords);
      const DeviceLocation& at = (*src.devices)[shard];
      int score = at.device_id == dst_device.device_id ? 2 : at.host == dst_device.host ? 1 : 0;
      if (score > best_score || (score == best_score && shard < best)) {
        best = shard;
        best_score = score;
      }
      if (best_score == 2) break;
    } while (Next(coords, replica_axes, lo, hi));

    Region source = s.ShardRegion(best);
    std::optional<Region> overlap = Intersect(source, target);
    if (overlap.has_value()) {
      Piece p;
      p.src_shard = best;
      p.src_region.size = overlap->size;
      for (size_t d = 0; d < overlap->start.size(); ++d) {
        p.src_region.start.push_back(overlap->start[d] - source.start[d]);
        p.dst_start.push_back(overlap->start[d] - target.start[d]);
      }
      pieces.push_back(std::move(p));
    }
  } while (Next(block, split_axes, lo, hi));
  return pieces;
}

}  // namespace pathways
