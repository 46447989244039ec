#include "collective/group.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"

namespace pathways::collective {

std::string CanonicalAxes(absl::string_view axes) {
  if (absl::StripAsciiWhitespace(axes).empty()) return "";
  std::vector<absl::string_view> names = absl::StrSplit(axes, ',');
  for (absl::string_view& name : names) name = absl::StripAsciiWhitespace(name);
  return absl::StrJoin(names, ",");
}

absl::StatusOr<Group> GroupOf(const GangLayout& layout, int64_t shard, absl::string_view axes) {
  const int rank_count = static_cast<int>(layout.mesh_dims.size());
  std::vector<int> named;
  if (absl::StripAsciiWhitespace(axes).empty()) {
    for (int a = 0; a < rank_count; ++a) named.push_back(a);
  } else {
    for (absl::string_view name : absl::StrSplit(axes, ',')) {
      name = absl::StripAsciiWhitespace(name);
      auto it = std::find(layout.axis_names.begin(), layout.axis_names.end(), name);
      if (it == layout.axis_names.end()) {
        return absl::InvalidArgumentError(absl::StrCat("collective over unknown mesh axis '", name,
                                                       "'; the mesh has axes [", absl::StrJoin(layout.axis_names, ", "),
                                                       "]"));
      }
      int a = static_cast<int>(it - layout.axis_names.begin());
      if (std::find(named.begin(), named.end(), a) != named.end()) {
        return absl::InvalidArgumentError(absl::StrCat("collective names mesh axis '", name, "' twice"));
      }
      named.push_back(a);
    }
  }
  int64_t total = 1;
  for (int64_t d : layout.mesh_dims) total *= d;
  if (shard < 0 || shard >= total || static_cast<int64_t>(layout.members.size()) != total) {
    return absl::InternalError(absl::StrCat("shard ", shard, " is not in a gang of ", layout.members.size(),
                                            " members over ", total, " mesh positions"));
  }
  // Row-major coordinates of the calling shard.
  std::vector<int64_t> coords(rank_count);
  for (int a = rank_count - 1; a >= 0; --a) {
    coords[a] = shard % layout.mesh_dims[a];
    shard /= layout.mesh_dims[a];
  }
  Group group;
  auto axis_name = [&](int a) {
    return a < static_cast<int>(layout.axis_names.size()) ? layout.axis_names[a] : absl::StrCat("axis ", a);
  };
  std::vector<std::string> over, at;
  for (int a : named) over.push_back(axis_name(a));
  for (int a = 0; a < rank_count; ++a) {
    if (std::find(named.begin(), named.end(), a) != named.end()) continue;
    absl::StrAppend(&group.id, a, "=", coords[a], ";");
    at.push_back(absl::StrCat(axis_name(a), "=", coords[a]));
  }
  int64_t size = 1;
  for (int a : named) size *= layout.mesh_dims[a];
  group.label = absl::StrCat("over [", absl::StrJoin(over, ", "), "]", at.empty() ? "" : " at ",
                             absl::StrJoin(at, ", "), " (", size, " members)");
  for (int64_t g = 0; g < size; ++g) {
    std::vector<int64_t> c = coords;
    bool is_me = true;
    int64_t rest = g;
    for (int k = static_cast<int>(named.size()) - 1; k >= 0; --k) {
      c[named[k]] = rest % layout.mesh_dims[named[k]];
      rest /= layout.mesh_dims[named[k]];
      if (c[named[k]] != coords[named[k]]) is_me = false;
    }
    int64_t linear = 0;
    for (int a = 0; a < rank_count; ++a) linear = linear * layout.mesh_dims[a] + c[a];
    if (is_me) group.rank = static_cast<int>(g);
    group.shards.push_back(linear);
  }
  return group;
}

absl::StatusOr<GroupPlacement> PlaceGroup(const GangLayout& layout, int64_t shard, absl::string_view axes,
                                          const std::string& host) {
  GroupPlacement p;
  PW_ASSIGN_OR_RETURN(p.group, GroupOf(layout, shard, axes));
  const size_t size = p.group.shards.size();
  std::vector<std::string> devices;
  for (size_t r = 0; r < size; ++r) {
    const Member& m = layout.members[p.group.shards[r]];
    p.hosts.push_back(m.host);
    devices.push_back(absl::StrCat(m.host, "/", m.device.value()));
    if (m.host == host) p.local.push_back(static_cast<int>(r));
  }
  if (p.local.empty()) {
    return absl::InternalError(
        absl::StrCat("shard ", shard, " runs on host ", host, " but its gang places it elsewhere"));
  }
  std::sort(p.hosts.begin(), p.hosts.end());
  p.hosts.erase(std::unique(p.hosts.begin(), p.hosts.end()), p.hosts.end());
  auto index = [&](const std::string& h) {
    return static_cast<int>(std::lower_bound(p.hosts.begin(), p.hosts.end(), h) - p.hosts.begin());
  };
  for (size_t r = 0; r < size; ++r) p.host_of.push_back(index(layout.members[p.group.shards[r]].host));
  p.mine = index(host);
  std::sort(devices.begin(), devices.end());
  p.devices = absl::StrJoin(devices, ",");
  return p;
}

}  // namespace pathways::collective
