#include "array/sharding.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pathways {

absl::StatusOr<Mesh> Mesh::Create(std::vector<int64_t> dims, std::vector<std::string> axis_names,
                                  int64_t max_devices) {
  if (dims.empty() || dims.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a mesh has 1 to 3 axes, got ", dims.size()));
  }
  if (axis_names.empty()) {
    static const char* kDefault[] = {"x", "y", "z"};
    for (size_t i = 0; i < dims.size(); ++i) axis_names.push_back(kDefault[i]);
  }
  if (axis_names.size() != dims.size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh has ", dims.size(), " axes but ",
                                                   axis_names.size(), " axis names"));
  }
  int64_t n = 1;
  std::set<std::string> seen;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis ", i, " has non-positive extent ", dims[i]));
    }
    if (n > max_devices / dims[i]) {
      return absl::InvalidArgumentError(absl::StrCat("mesh ", ShapeToString(dims), " has more than ",
                                                     max_devices, " devices"));
    }
    n *= dims[i];
    if (axis_names[i].empty() || !seen.insert(axis_names[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh axis names must be distinct and non-empty, got [",
                       absl::StrJoin(axis_names, ","), "]"));
    }
    // Collectives name axes in a comma-separated list: a name must be one word to be named there.
    const std::string& name = axis_names[i];
    if (name.size() > 64 || !std::all_of(name.begin(), name.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
        })) {
      return absl::InvalidArgumentError(absl::StrCat("mesh axis name '", absl::CHexEscape(name.substr(0, 64)),
                                                     "' is not 1 to 64 letters, digits, '_' or '-'"));
    }
  }
  return Mesh{std::move(dims), std::move(axis_names)};
}

int64_t Mesh::num_devices() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

int Mesh::AxisIndex(const std::string& name) const {
  for (size_t i = 0; i < axis_names.size(); ++i) {
    if (axis_names[i] == name) return static_cast<int>(i);
  }
  return -1;
}

std::vector<int64_t> Mesh::Coordinates(int64_t device_index) const {
  std::vector<int64_t> coords(dims.size());
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    coords[i] = device_index % dims[i];
    device_index /= dims[i];
  }
  return coords;
}

std::string Mesh::ToString() const {
  std::vector<std::string> parts;
  for (size_t i = 0; i < dims.size(); ++i) parts.push_back(absl::StrCat(axis_names[i], "=", dims[i]));
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

std::vector<std::string> SpecAxes(const std::string& entry) {
  if (entry.empty()) return {};
  return absl::StrSplit(entry, ',');
}

std::string PartitionSpecToString(const PartitionSpec& spec) {
  std::vector<std::string> parts;
  for (const auto& s : spec) parts.push_back(s.empty() ? "-" : s.find(',') == std::string::npos ? s : absl::StrCat("(", s, ")"));
  return absl::StrCat("(", absl::StrJoin(parts, ","), ")");
}

std::string Region::ToString() const {
  return absl::StrCat("start", ShapeToString(start), " size", ShapeToString(size));
}

std::optional<Region> Intersect(const Region& a, const Region& b) {
  Region r;
  for (size_t i = 0; i < a.start.size(); ++i) {
    int64_t lo = std::max(a.start[i], b.start[i]);
    int64_t hi = std::min(a.start[i] + a.size[i], b.start[i] + b.size[i]);
    if (hi <= lo) return std::nullopt;
    r.start.push_back(lo);
    r.size.push_back(hi - lo);
  }
  return r;
}

absl::StatusOr<Sharding> Sharding::Create(const Mesh& mesh, const PartitionSpec& spec,
                                          const Shape& global_shape) {
  PartitionSpec full = spec;
  if (full.empty()) full.assign(global_shape.size(), "");  // empty spec: fully replicated
  if (full.size() != global_shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition spec ", PartitionSpecToString(spec), " has ", spec.size(),
                     " entries for an array of rank ", global_shape.size()));
  }
  auto n = NumElements(global_shape);
  if (!n.ok()) return n.status();
  Sharding s;
  s.mesh_ = mesh;
  s.spec_ = full;
  s.global_shape_ = global_shape;
  s.local_shape_ = global_shape;
  std::set<std::string> used;
  for (size_t d = 0; d < full.size(); ++d) {
    if (full[d].empty()) continue;
    int64_t parts = 1;
    for (const std::string& name : SpecAxes(full[d])) {
      const int axis = mesh.AxisIndex(name);
      if (axis < 0) {
        return absl::InvalidArgumentError(absl::StrCat("partition spec ", PartitionSpecToString(spec),
                                                       " names mesh axis '", name, "', which mesh ", mesh.ToString(),
                                                       " does not have"));
      }
      if (!used.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat("mesh axis '", name, "' splits more than once in ",
                                                       PartitionSpecToString(spec)));
      }
      parts *= mesh.dims[axis];
    }
    if (global_shape[d] % parts != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dimension ", d, " of shape ", ShapeToString(global_shape), " (", global_shape[d],
          ") does not divide evenly over mesh axis '", full[d], "' of size ", parts));
    }
    s.local_shape_[d] = global_shape[d] / parts;
  }
  return s;
}

Region Sharding::ShardRegion(int64_t index) const {
  std::vector<int64_t> coords = mesh_.Coordinates(index);
  Region r;
  r.size = local_shape_;
  r.start.assign(global_shape_.size(), 0);
  for (size_t d = 0; d < spec_.size(); ++d) {
    int64_t block = 0;  // mixed radix over the entry's axes, the first major
    for (const std::string& name : SpecAxes(spec_[d])) {
      const int axis = mesh_.AxisIndex(name);
      block = block * mesh_.dims[axis] + coords[axis];
    }
    r.start[d] = block * local_shape_[d];
  }
  return r;
}

absl::Status CheckRegionInside(const Region& region, const Shape& shape) {
  if (region.start.size() != shape.size() || region.size.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("region ", region.ToString(),
                                                   " does not match the rank of shape ",
                                                   ShapeToString(shape)));
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (region.start[i] < 0 || region.size[i] < 0 || region.start[i] > shape[i] ||
        region.size[i] > shape[i] - region.start[i]) {
      return absl::InvalidArgumentError(absl::StrCat("region ", region.ToString(),
                                                     " lies outside shape ", ShapeToString(shape)));
    }
  }
  return absl::OkStatus();
}

std::optional<std::pair<int64_t, int64_t>> ContiguousSpan(const Shape& shape, const Region& region) {
  const int rank = static_cast<int>(shape.size());
  int partial = -1;  // the last dimension the region does not cover whole
  for (int i = 0; i < rank; ++i) {
    if (region.start[i] != 0 || region.size[i] != shape[i]) partial = i;
  }
  for (int i = 0; i < partial; ++i) {
    if (region.size[i] != 1) return std::nullopt;
  }
  int64_t offset = 0, count = 1;
  for (int i = 0; i < rank; ++i) {
    offset = offset * shape[i] + region.start[i];
    count *= region.size[i];
  }
  return std::make_pair(offset, count);
}

void CopyRegion(const char* src, const Shape& src_shape, const Shape& src_start, const Shape& size,
                size_t element_size, char* dst, const Shape& dst_shape, const Shape& dst_start) {
  const size_t rank = size.size();
  for (int64_t s : size) {
    if (s == 0) return;
  }
  if (rank == 0) {
    std::memcpy(dst, src, element_size);
    return;
  }
  // Row-major strides in elements.
  std::vector<int64_t> src_stride(rank, 1), dst_stride(rank, 1);
  for (int i = static_cast<int>(rank) - 2; i >= 0; --i) {
    src_stride[i] = src_stride[i + 1] * src_shape[i + 1];
    dst_stride[i] = dst_stride[i + 1] * dst_shape[i + 1];
  }
  const size_t row_bytes = static_cast<size_t>(size[rank - 1]) * element_size;
  std::vector<int64_t> index(rank, 0);  // over all dims but the last
  while (true) {
    int64_t src_off = 0, dst_off = 0;
    for (size_t i = 0; i < rank; ++i) {
      src_off += (src_start[i] + index[i]) * src_stride[i];
      dst_off += (dst_start[i] + index[i]) * dst_stride[i];
    }
    std::memcpy(dst + dst_off * element_size, src + src_off * element_size, row_bytes);
    int d = static_cast<int>(rank) - 2;
    while (d >= 0 && ++index[d] == size[d]) index[d--] = 0;
    if (d < 0) return;
  }
}

}  // namespace pathways
