#include "core/dcn_emulation.h"

#include <algorithm>

namespace pathways {

void DcnEmulation::NoteHost(const std::string& host, int island) {
  absl::MutexLock lock(&mu_);
  islands_[host] = island;
}

bool DcnEmulation::Crosses(const std::string& host) const {
  absl::MutexLock lock(&mu_);
  auto it = islands_.find(host);
  return it != islands_.end() && it->second != island_;
}

absl::Duration DcnEmulation::WireTime(size_t bytes) const {
  if (options_.gbps <= 0) return absl::ZeroDuration();
  return absl::Nanoseconds(static_cast<int64_t>(static_cast<double>(bytes) * 8.0 / options_.gbps));
}

absl::Time DcnEmulation::Arrival(const std::string& host, size_t bytes, absl::Time now) {
  if (!Crosses(host)) return now;
  absl::MutexLock lock(&mu_);
  absl::Time& free = link_free_[host];
  const absl::Time departs = std::max(now, free);
  free = departs + WireTime(bytes);
  return free + options_.latency;
}

}  // namespace pathways
