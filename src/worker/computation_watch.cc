#include "worker/computation_watch.h"

#include "absl/strings/str_cat.h"
#include "core/ids.h"

namespace pathways {

ComputationWatch::ComputationWatch(int num_devices) : devices_(static_cast<size_t>(std::max(num_devices, 0))) {}

void ComputationWatch::Begin(int device, WorkLabel label, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (device < 0 || device >= static_cast<int>(devices_.size())) return;
  devices_[device] = {true, std::move(label), now};
}

void ComputationWatch::End(int device) {
  absl::MutexLock lock(&mu_);
  if (device < 0 || device >= static_cast<int>(devices_.size())) return;
  devices_[device].busy = false;
}

std::optional<ComputationWatch::Overrun> ComputationWatch::LongerThan(absl::Duration limit, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::optional<Overrun> longest;
  for (size_t d = 0; d < devices_.size(); ++d) {
    const Running& r = devices_[d];
    if (!r.busy || now - r.since <= limit) continue;
    if (longest.has_value() && now - r.since <= longest->running) continue;
    longest = Overrun{static_cast<int>(d), r.label, now - r.since};
  }
  return longest;
}

std::string DescribeOverrun(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit) {
  const WorkLabel& l = overrun.label;
  return absl::StrCat("device ", overrun.device, " of host ", host, " has run one computation ('", l.name,
                      "', shard ", l.shard, " of run ", l.run, " of client ", ClientLabel(l.client), ") for ",
                      absl::FormatDuration(absl::Trunc(overrun.running, absl::Milliseconds(1))),
                      ", past the worker's computation timeout of ", absl::FormatDuration(limit),
                      " (--computation-timeout-ms); a device cannot be preempted, so the host leaves the cluster "
                      "and its runs fail (a supervisor starts the worker again)");
}

}  // namespace pathways
