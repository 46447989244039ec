#include "controller/cluster_registry.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/ids.h"
#include "core/logging.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

// The id `next` holds, and the one after it from now on.
template <typename IdT>
IdT TakeNext(IdT& next) {
  const IdT id = next;
  next = next + 1;
  return id;
}

constexpr int kMaxDevicesPerHost = 4096;
}  // namespace

absl::StatusOr<rpc::RegisterWorkerResponse> ClusterRegistry::RegisterWorker(
    const rpc::RegisterWorkerRequest& r, absl::Time now) {
  if (r.address().empty()) return absl::InvalidArgumentError("worker registered without an address");
  if (r.devices_size() == 0 || r.devices_size() > kMaxDevicesPerHost) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker must have 1 to ", kMaxDevicesPerHost, " devices, has ", r.devices_size()));
  }
  if (r.island() < 0) return absl::InvalidArgumentError("island must be non-negative");
  absl::MutexLock lock(&mu_);
  std::optional<HostId> host_id;
  for (const auto& [id, h] : hosts_) {
    if (h.address == r.address()) host_id = id;
  }
  // An address names one worker process at a time: a different process may take it over only
  // once the one there stopped heartbeating (a restart after a crash waits that long).
  if (host_id.has_value()) {
    const Host& held = hosts_[*host_id];
    if (held.incarnation != r.incarnation() && AliveLocked(held, now)) {
      return absl::AlreadyExistsError(absl::StrCat(
          "address ", r.address(), " belongs to a live worker (heard from ",
          absl::ToInt64Milliseconds(now - held.last_heartbeat),
          " ms ago); another worker cannot take it over until that one stops heartbeating"));
    }
  }
  int32_t island_rank = 0;
  for (const auto& [id, h] : hosts_) {
    if (id != host_id && h.island == r.island()) ++island_rank;
  }
  if (host_id.has_value() && hosts_[*host_id].island == r.island()) island_rank = hosts_[*host_id].island_rank;
  if (!host_id.has_value()) host_id = TakeNext(next_host_id_);
  Host& host = hosts_[*host_id];
  host.island_rank = island_rank;
  host.host_id = *host_id;
  host.island = r.island();
  host.address = r.address();
  host.incarnation = r.incarnation();
  host.last_heartbeat = now;
  host.left.clear();
  host.made_leave = absl::InfinitePast();  // a new process's record starts afresh
  std::vector<Device> old = std::move(host.devices);
  host.devices.clear();
  rpc::RegisterWorkerResponse response;
  response.set_host_id(static_cast<int32_t>(host_id->value()));
  response.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(heartbeat_timeout_) / 4);
  for (int i = 0; i < r.devices_size(); ++i) {
    Device d;
    d.info = r.devices(i);
    d.info.clear_recent_work();  // heartbeats' to report, and kept apart from the device's info
    d.info.set_local_index(i);
    // Keep device ids stable across a re-registration of the same host.
    d.info.set_device_id(i < static_cast<int>(old.size()) ? old[i].info.device_id()
                                                          : static_cast<int32_t>(TakeNext(next_device_id_).value()));
    d.info.clear_coords();
    d.info.add_coords(island_rank);
    d.info.add_coords(i);
    response.add_device_ids(d.info.device_id());
    host.devices.push_back(std::move(d));
  }
  return response;
}

namespace {

// Adds `from`'s device time into `into` (a bucket of the same span), client by client, each
// client's time within the bucket's width.
void AddBucket(const rpc::WorkBucket& from, rpc::WorkBucket& into) {
  const int64_t width = into.end_us() - into.start_us();
  for (const rpc::ClientTime& t : from.busy()) {
    const std::string label = ClientLabel(t.client_id());  // a label, whatever was sent
    const int64_t micros = std::clamp<int64_t>(t.busy_micros(), 0, width);
    auto it = std::find_if(into.mutable_busy()->begin(), into.mutable_busy()->end(),
                           [&](const rpc::ClientTime& c) { return c.client_id() == label; });
    if (it != into.mutable_busy()->end()) {
      it->set_busy_micros(std::min(width, it->busy_micros() + micros));
    } else if (into.busy_size() < ClusterRegistry::kMaxBucketClients) {
      rpc::ClientTime* added = into.add_busy();
      added->set_client_id(label);
      added->set_busy_micros(micros);
    }
  }
}

// Adds a heartbeat's buckets to a device's, in start order (a bucket reported again, for work
// that ended since, adds up). Only what a worker can honestly send is taken: at most
// kMaxBucketsPerBeat buckets, each at most kMaxBucketWidth wide and within the kept window
// around `now`; what ended before the window or is beyond the bound goes.
void KeepRecentWork(const google::protobuf::RepeatedPtrField<rpc::WorkBucket>& reported, absl::Time now,
                    std::deque<rpc::WorkBucket>& kept) {
  const int64_t kept_after = absl::ToUnixMicros(now - ClusterRegistry::kTimelineKept);
  const int64_t latest = absl::ToUnixMicros(now + ClusterRegistry::kTimelineKept);  // clocks differ a little
  const int reported_count = std::min(reported.size(), ClusterRegistry::kMaxBucketsPerBeat);
  for (int i = reported.size() - reported_count; i < reported.size(); ++i) {  // the newest, when too many
    const rpc::WorkBucket& b = reported[i];
    const int64_t width = b.end_us() - b.start_us();
    if (b.end_us() < kept_after || b.start_us() > latest || width <= 0 ||
        width > absl::ToInt64Microseconds(ClusterRegistry::kMaxBucketWidth)) {
      continue;
    }
    auto at = std::lower_bound(kept.begin(), kept.end(), b.start_us(),
                               [](const rpc::WorkBucket& k, int64_t start) { return k.start_us() < start; });
    if (at == kept.end() || at->start_us() != b.start_us()) {
      at = kept.insert(at, rpc::WorkBucket());
      at->set_start_us(b.start_us());
      at->set_end_us(b.end_us());
    }
    AddBucket(b, *at);
  }
  while (!kept.empty() && kept.front().end_us() < kept_after) kept.pop_front();
  while (kept.size() > ClusterRegistry::kMaxTimelineBuckets) kept.pop_front();
}

// Bounds finite, positive and strictly increasing, no more of them than kMaxLatencyBounds, one
// more bucket than bounds, counts not negative and their total without overflow.
bool HistogramHoldsTogether(const rpc::HostCounters& c) {
  const auto& bounds = c.latency_bounds_us();
  if (bounds.size() > ClusterRegistry::kMaxLatencyBounds || c.latency_buckets_size() != bounds.size() + 1) return false;
  for (int i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || bounds[i] <= 0 || (i > 0 && !(bounds[i] > bounds[i - 1]))) return false;
  }
  int64_t total = 0;
  for (int64_t n : c.latency_buckets()) {
    if (n < 0 || __builtin_add_overflow(total, n, &total)) return false;
  }
  return c.latency_sum_us() >= 0;
}

}  // namespace

void ClusterRegistry::Awake(absl::Time now) {
  absl::MutexLock lock(&mu_);
  const absl::Duration away = stall_.Awake(now);
  if (away == absl::ZeroDuration()) return;
  for (auto& [id, host] : hosts_) host.last_heartbeat = StallCredit::Credited(host.last_heartbeat, now, away);
  PW_LOG(Warning) << "the controller was away for " << absl::FormatDuration(away)
                  << " (frozen or starved of CPU): hosts are not judged by that silence";
}

ClusterRegistry::Beat ClusterRegistry::Heartbeat(const rpc::HeartbeatRequest& r, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = hosts_.find(HostId(r.host_id()));
  if (it == hosts_.end()) return Beat::kUnknown;
  Host& host = it->second;
  if (host.address != r.address()) return Beat::kUnknown;  // the id is another worker's here: register
  // A newer process took this address meanwhile (this one was silent): this one must leave.
  if (host.incarnation != r.incarnation()) return Beat::kExpired;
  if (!r.leaving().empty()) {
    // It leaves, and says why: departed from now on, with its reason, even when it was already
    // silent past the timeout (its last word says more than that does).
    if (!host.left.empty()) return Beat::kExpired;
    host.left = r.leaving().substr(0, kMaxLeaveReason);
    return Beat::kLeft;
  }
  if (SilentLocked(host, now) || !host.left.empty()) return Beat::kExpired;
  host.last_heartbeat = now;
  for (const rpc::DeviceInfo& d : r.devices()) {
    if (d.local_index() < 0 || d.local_index() >= static_cast<int>(host.devices.size())) continue;
    rpc::DeviceInfo& info = host.devices[d.local_index()].info;
    info.set_memory_used(d.memory_used());
    info.set_memory_peak(d.memory_peak());
    info.set_executed(d.executed());
    info.set_busy_micros(d.busy_micros());
    *info.mutable_client_time() = d.client_time();
    KeepRecentWork(d.recent_work(), now, host.devices[d.local_index()].recent_work);
  }
  host.counters = r.counters();
  // Labels as the workers make them, and not more of them than a worker keeps.
  auto* failed = host.counters.mutable_failed_shards();
  if (failed->size() > kMaxFailureLabels) failed->DeleteSubrange(kMaxFailureLabels, failed->size() - kMaxFailureLabels);
  for (rpc::ClientCount& f : *failed) {
    f.set_client_id(ClientLabel(f.client_id()));
  }
  // A histogram that does not hold together is not served (metrics would mislead).
  if (!HistogramHoldsTogether(host.counters)) {
    host.counters.clear_latency_bounds_us();
    host.counters.clear_latency_buckets();
    host.counters.clear_latency_sum_us();
  }
  return Beat::kAlive;
}

const ClusterRegistry::Host* ClusterRegistry::SenderLocked(const rpc::HeartbeatRequest& r) const {
  auto it = hosts_.find(HostId(r.host_id()));
  if (it == hosts_.end() || it->second.address != r.address() || it->second.incarnation != r.incarnation()) {
    return nullptr;
  }
  return &it->second;
}

std::string ClusterRegistry::WhyLeft(const rpc::HeartbeatRequest& r) const {
  absl::MutexLock lock(&mu_);
  const Host* host = SenderLocked(r);
  return host == nullptr ? "" : host->left;
}

namespace {

// What a host could not deliver to `peer`, for a reason that host or the peer hears.
std::string Undelivered(const rpc::UnreachablePeer& peer) {
  if (peer.refused()) {
    return absl::StrCat("refused dataflow batches for ", peer.address(), " (more waited for it than a sender holds)");
  }
  return absl::StrCat("could not deliver dataflow batches to ", peer.address(), " for ",
                      absl::FormatDuration(absl::Milliseconds(peer.stalled_ms())), " (", peer.bytes(),
                      " bytes waiting)");
}

}  // namespace

std::vector<std::string> ClusterRegistry::ReportUnreachable(const rpc::HeartbeatRequest& reporter, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = hosts_.find(HostId(reporter.host_id()));
  if (it == hosts_.end() || &it->second != SenderLocked(reporter) || !AliveLocked(it->second, now)) return {};
  Host& from = it->second;
  // The live peers it names, once each.
  std::vector<std::pair<Host*, const rpc::UnreachablePeer*>> named;
  for (const rpc::UnreachablePeer& peer : reporter.unreachable()) {
    for (auto& [id, h] : hosts_) {
      if (h.address != peer.address() || &h == &from || !AliveLocked(h, now)) continue;
      Host* host = &h;
      if (std::none_of(named.begin(), named.end(), [host](const auto& n) { return n.first == host; })) {
        named.emplace_back(host, &peer);
      }
    }
  }
  if (named.empty()) return {};
  // A host that reaches two peers no better, at once or within the window, is the one cut off.
  if (named.size() > 1 || now - from.made_leave < kCutOffWindow) {
    std::vector<std::string> what;
    for (const auto& [h, peer] : named) what.push_back(Undelivered(*peer));
    from.left = absl::StrCat("it ", absl::StrJoin(what, "; "),
                             named.size() > 1 ? "" : ", after another host it could not reach had to leave",
                             ": this host is the one cut off")
                    .substr(0, kMaxLeaveReason);  // every heartbeat answer and status carries it
    return {from.address};
  }
  Host& to = *named[0].first;
  to.left = absl::StrCat("host ", from.address, " ", Undelivered(*named[0].second),
                         ": it is cut off from its peers (a partition, or a process too slow to read)")
                .substr(0, kMaxLeaveReason);
  from.made_leave = now;
  return {to.address};
}

rpc::ClusterStatus ClusterRegistry::Status(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  rpc::ClusterStatus status;
  for (const auto& [id, h] : hosts_) {
    rpc::HostStatus* hs = status.add_hosts();
    hs->set_host_id(static_cast<int32_t>(id.value()));
    hs->set_island(h.island);
    hs->set_address(h.address);
    hs->set_alive(AliveLocked(h, now));
    hs->set_millis_since_heartbeat(absl::ToInt64Milliseconds(now - h.last_heartbeat));
    hs->set_left(h.left);
    for (const Device& d : h.devices) *hs->add_devices() = d.info;
    *hs->mutable_counters() = h.counters;
  }
  for (const auto& [id, slice] : slices_) {
    rpc::SliceStatus* s = status.add_slices();
    s->set_slice_id(id.value());
    s->set_client_id(slice.request.client_id());
    *s->mutable_mesh_shape() = slice.request.mesh_shape();
    s->set_device_kind(slice.request.device_kind());
    for (const Placed& p : slice.devices) s->add_device_ids(static_cast<int32_t>(p.device_id.value()));
  }
  return status;
}

rpc::ClusterTimeline ClusterRegistry::Timeline(absl::Time now, absl::Duration window) const {
  absl::MutexLock lock(&mu_);
  rpc::ClusterTimeline timeline;
  timeline.set_now_us(absl::ToUnixMicros(now));
  timeline.set_window_us(absl::ToInt64Microseconds(window));
  const int64_t after = absl::ToUnixMicros(now - window);
  for (const auto& [id, h] : hosts_) {
    for (const Device& d : h.devices) {
      rpc::DeviceTimeline* t = timeline.add_devices();
      t->set_device_id(d.info.device_id());
      t->set_host(h.address);
      t->set_local_index(d.info.local_index());
      for (const rpc::WorkBucket& bucket : d.recent_work) {
        if (bucket.end_us() >= after) *t->add_buckets() = bucket;
      }
    }
  }
  return timeline;
}

std::vector<ClusterRegistry::Departed> ClusterRegistry::DepartedHosts(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<Departed> departed;
  for (const auto& [id, h] : hosts_) {
    if (!AliveLocked(h, now)) departed.push_back({h.address, h.left});
  }
  return departed;
}

std::vector<ClusterRegistry::LiveHost> ClusterRegistry::LiveHosts(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::vector<LiveHost> live;
  for (const auto& [id, h] : hosts_) {
    if (AliveLocked(h, now)) live.push_back({h.island, h.address, h.incarnation});
  }
  return live;
}

absl::StatusOr<int32_t> ClusterRegistry::IslandOf(const std::string& address, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, h] : hosts_) {
    if (h.address != address) continue;
    if (!h.left.empty()) return absl::UnavailableError(absl::StrCat("host ", address, " left: ", h.left));
    if (!AliveLocked(h, now)) return absl::UnavailableError(absl::StrCat("host ", address, " stopped heartbeating"));
    return h.island;
  }
  return absl::NotFoundError(absl::StrCat("no worker at ", address, " is registered"));
}

absl::Status ClusterRegistry::CheckClientMayUse(const std::string& client_id, const std::string& address) const {
  absl::MutexLock lock(&mu_);
  auto it = client_hosts_.find(client_id);
  if (it != client_hosts_.end() && it->second.contains(address)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("a run names host ", address, ", where client ",
                                                  ClientLabel(client_id),
                                                  " has no slice (a client that went away and came back has lost "
                                                  "its slices: connect again)"));
}

void ClusterRegistry::NoteClientOnHost(const std::string& client_id, const std::string& address) {
  absl::MutexLock lock(&mu_);
  client_hosts_[client_id].insert(address);
}

void ClusterRegistry::ForgetClient(const std::string& client_id) {
  absl::MutexLock lock(&mu_);
  client_hosts_.erase(client_id);
  for (auto it = slices_.begin(); it != slices_.end();) {
    if (it->second.request.client_id() != client_id) {
      ++it;
      continue;
    }
    ReleaseLocked(it->second);
    it = slices_.erase(it);
  }
}

}  // namespace pathways
