// The cluster registry's resource manager part: virtual slices placed on islands' devices,
// released, remapped after a host leaves, and their states as clients see them.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "controller/cluster_registry.h"
#include "core/ids.h"
#include "core/status_macros.h"
#include "core/types.h"

namespace pathways {
namespace {

constexpr int64_t kMaxSliceDevices = 1 << 20;

}  // namespace

absl::StatusOr<rpc::AllocateSliceResponse> ClusterRegistry::AllocateSlice(
    const rpc::AllocateSliceRequest& r, absl::Time now) {
  if (r.mesh_shape_size() < 1 || r.mesh_shape_size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("a slice's mesh has 1 to 3 axes, got ", r.mesh_shape_size()));
  }
  int64_t wanted = 1;
  for (int64_t d : r.mesh_shape()) {
    if (d <= 0 || wanted > kMaxSliceDevices / d) {
      return absl::InvalidArgumentError(absl::StrCat("mesh shape ", ShapeToString(Shape(r.mesh_shape().begin(), r.mesh_shape().end())),
                                                     " is not a positive shape of at most ",
                                                     kMaxSliceDevices, " devices"));
    }
    wanted *= d;
  }
  if (r.min_free_memory_bytes() < 0) return absl::InvalidArgumentError("minimum free memory must not be negative");
  absl::MutexLock lock(&mu_);
  rpc::AllocateSliceResponse response;
  PW_RETURN_IF_ERROR(PlaceLocked(r, next_slice_id_, now, response));
  next_slice_id_ = next_slice_id_ + 1;
  return response;
}

absl::Status ClusterRegistry::PlaceLocked(const rpc::AllocateSliceRequest& r, SliceId slice_id, absl::Time now,
                                          rpc::AllocateSliceResponse& response) {
  int64_t wanted = 1;
  for (int64_t d : r.mesh_shape()) wanted *= d;
  struct Candidate {
    Host* host;
    Device* device;
  };
  std::vector<Candidate> candidates;
  for (auto& [id, h] : hosts_) {
    if (!AliveLocked(h, now)) continue;
    if (r.has_island() && h.island != r.island()) continue;
    for (Device& d : h.devices) {
      if (!r.device_kind().empty() && d.info.kind() != r.device_kind()) continue;
      if (d.info.memory_capacity() - d.info.memory_used() < r.min_free_memory_bytes()) continue;
      candidates.push_back({&h, &d});
    }
  }
  // Picks `wanted` devices of `pool` (all of one kind, named `kind` in refusals when it was
  // chosen): within one island unless the request pins one or lets the slice span islands.
  auto select = [&](std::vector<Candidate> pool, const std::string& kind) -> absl::StatusOr<std::vector<Candidate>> {
    if (static_cast<int64_t>(pool.size()) < wanted) {
      std::string constraints;
      if (r.has_island()) absl::StrAppend(&constraints, " in island ", r.island());
      if (!kind.empty()) absl::StrAppend(&constraints, " of kind '", kind, "'");
      if (r.min_free_memory_bytes() > 0) {
        absl::StrAppend(&constraints, " with at least ", r.min_free_memory_bytes(), " bytes free");
      }
      return absl::ResourceExhaustedError(absl::StrCat("a slice of ", wanted, " devices was requested but only ",
                                                       pool.size(), " live devices are available", constraints));
    }
    std::stable_sort(pool.begin(), pool.end(), [](const Candidate& a, const Candidate& b) {
      return a.device->slices < b.device->slices;
    });
    if (r.has_island() || r.span_islands()) return pool;
    // Within one island: the least loaded one that fits (fewest slices on its chosen devices,
    // then the lowest id). A gang over several islands crosses the data-centre network, so the
    // client has to ask for one.
    std::map<int32_t, std::vector<Candidate>> by_island;
    for (const Candidate& c : pool) by_island[c.host->island].push_back(c);
    const std::vector<Candidate>* best = nullptr;
    int64_t best_load = 0;
    size_t largest = 0;
    for (const auto& [island, in_island] : by_island) {
      largest = std::max(largest, in_island.size());
      if (static_cast<int64_t>(in_island.size()) < wanted) continue;
      int64_t load = 0;
      for (int64_t i = 0; i < wanted; ++i) load += in_island[i].device->slices;
      if (best == nullptr || load < best_load) {
        best = &in_island;
        best_load = load;
      }
    }
    if (best == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "a slice of ", wanted, " devices was requested but no island has that many live devices",
          kind.empty() ? "" : absl::StrCat(" of kind '", kind, "'"), " (the largest has ", largest,
          "); pin an island, or allow the slice to span islands (SliceSpec::span_islands)"));
    }
    return *best;
  };
  // One kind per slice: a gang computes with one compiler on one kind of device (a slice over
  // simulated and CPU devices would mix modelled and computed results). Without a kind asked for,
  // each kind present is tried, the most numerous first (then by name), and the first that can
  // hold the slice is taken; the slice then keeps that kind, remaps included.
  std::map<std::string, int64_t> per_kind;
  for (const Candidate& c : candidates) ++per_kind[c.device->info.kind()];
  absl::StatusOr<std::vector<Candidate>> chosen;
  if (!r.device_kind().empty() || per_kind.size() <= 1) {
    chosen = select(candidates, r.device_kind());
  } else {
    std::vector<std::pair<int64_t, std::string>> kinds;
    for (const auto& [kind, count] : per_kind) kinds.push_back({-count, kind});
    std::sort(kinds.begin(), kinds.end());
    absl::Status first_refusal;  // the most numerous kind's, if none can hold the slice
    for (const auto& [count, kind] : kinds) {
      std::vector<Candidate> of_kind;
      for (const Candidate& c : candidates) {
        if (c.device->info.kind() == kind) of_kind.push_back(c);
      }
      chosen = select(std::move(of_kind), kind);
      if (chosen.ok()) break;
      if (first_refusal.ok()) first_refusal = chosen.status();
    }
    if (!chosen.ok()) chosen = first_refusal;
  }
  if (!chosen.ok()) return chosen.status();
  candidates = *std::move(chosen);
  const std::string chosen_kind = candidates.front().device->info.kind();
  candidates.resize(wanted);
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return std::make_pair(a.host->host_id, a.device->info.local_index()) <
           std::make_pair(b.host->host_id, b.device->info.local_index());
  });
  response.set_slice_id(slice_id.value());
  Slice& slice = slices_[slice_id];
  ReleaseLocked(slice);  // a remapped slice stops loading the devices it leaves
  slice.request = r;  // (r may be slice.request itself, for a remap)
  slice.request.clear_credential();  // checked already; not kept
  slice.request.set_device_kind(chosen_kind);
  slice.devices.clear();
  std::set<std::string>& client_hosts = client_hosts_[r.client_id()];
  for (const Candidate& c : candidates) {
    ++c.device->slices;
    client_hosts.insert(c.host->address);
    slice.devices.push_back({c.host->host_id, DeviceId(c.device->info.device_id()), c.host->incarnation});
    rpc::PhysicalDevice* p = response.add_devices();
    p->set_device_id(c.device->info.device_id());
    p->set_host_id(static_cast<int32_t>(c.host->host_id.value()));
    p->set_host_address(c.host->address);
    p->set_local_index(c.device->info.local_index());
    p->set_island(c.host->island);
    *p->mutable_coords() = c.device->info.coords();
    p->set_incarnation(c.host->incarnation);
    p->set_memory_capacity(c.device->info.memory_capacity());
  }
  return absl::OkStatus();
}

void ClusterRegistry::ReleaseLocked(const Slice& slice) {
  for (const Placed& p : slice.devices) {
    auto h = hosts_.find(p.host_id);
    if (h == hosts_.end()) continue;
    for (Device& d : h->second.devices) {
      if (DeviceId(d.info.device_id()) == p.device_id && d.slices > 0) --d.slices;
    }
  }
}

std::string ClusterRegistry::LostReasonLocked(const Slice& s, absl::Time now) const {
  std::set<std::string> gone;
  for (const Placed& p : s.devices) {
    auto h = hosts_.find(p.host_id);
    if (h == hosts_.end()) {
      gone.insert(absl::StrCat("host ", p.host_id.value(), " is gone"));
      continue;
    }
    if (!h->second.left.empty()) {
      gone.insert(absl::StrCat("host ", h->second.address, " left: ", h->second.left));
      continue;
    }
    if (!AliveLocked(h->second, now)) {
      gone.insert(absl::StrCat("host ", h->second.address, " stopped heartbeating"));
      continue;
    }
    bool present = false;
    for (const Device& d : h->second.devices) present = present || DeviceId(d.info.device_id()) == p.device_id;
    if (!present || h->second.incarnation != p.incarnation) {
      gone.insert(absl::StrCat("host ", h->second.address, " restarted (what was on it is gone)"));
    }
  }
  return absl::StrJoin(gone, "; ");
}

rpc::SliceStatesResponse ClusterRegistry::SliceStates(const std::string& client_id, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  rpc::SliceStatesResponse response;
  for (const auto& [id, s] : slices_) {
    if (s.request.client_id() != client_id) continue;
    rpc::SliceState* state = response.add_slices();
    state->set_slice_id(id.value());
    state->set_reason(LostReasonLocked(s, now));
    state->set_lost(!state->reason().empty());
  }
  return response;
}

absl::StatusOr<rpc::AllocateSliceResponse> ClusterRegistry::RemapSlice(const rpc::RemapSliceRequest& r,
                                                                       absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = slices_.find(SliceId(r.slice_id()));
  if (it == slices_.end() || it->second.request.client_id() != r.client_id()) {
    return absl::NotFoundError(absl::StrCat("client ", r.client_id(), " has no slice ", r.slice_id()));
  }
  rpc::AllocateSliceResponse response;
  PW_RETURN_IF_ERROR(PlaceLocked(it->second.request, it->first, now, response));
  return response;
}

}  // namespace pathways
