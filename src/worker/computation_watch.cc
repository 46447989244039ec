#include "worker/computation_watch.h"

#include "absl/strings/str_cat.h"
#include "core/ids.h"

namespace pathways {

ComputationWatch::ComputationWatch(int num_devices)
    : num_devices_(std::max(num_devices, 0)),
      stop_(std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(num_devices_))),
      devices_(static_cast<size_t>(num_devices_)) {}

void ComputationWatch::Begin(int device, WorkLabel label, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (device < 0 || device >= num_devices_) return;
  devices_[device] = {true, std::move(label), now};
  stop_[device].store(false);
}

void ComputationWatch::End(int device) {
  absl::MutexLock lock(&mu_);
  if (device < 0 || device >= num_devices_) return;
  devices_[device].busy = false;
}

std::vector<ComputationWatch::Overrun> ComputationWatch::StopLongerThan(
    absl::Duration limit, absl::Time now, const std::function<std::string(const Overrun&)>& why) {
  absl::MutexLock lock(&mu_);
  std::vector<Overrun> asked;
  for (int d = 0; d < num_devices_; ++d) {
    Running& r = devices_[d];
    if (!r.busy || r.stop_asked.has_value() || now - r.since <= limit) continue;
    Overrun overrun{d, r.label, now - r.since};
    r.stop_asked = now;
    r.stop_reason = why(overrun);
    stop_[d].store(true);
    asked.push_back(std::move(overrun));
  }
  return asked;
}

std::optional<ComputationWatch::Overrun> ComputationWatch::NotStopped(absl::Duration grace, absl::Time now) const {
  absl::MutexLock lock(&mu_);
  std::optional<Overrun> longest;
  for (int d = 0; d < num_devices_; ++d) {
    const Running& r = devices_[d];
    if (!r.busy || !r.stop_asked.has_value() || now - *r.stop_asked < grace) continue;
    if (longest.has_value() && now - r.since <= longest->running) continue;
    longest = Overrun{d, r.label, now - r.since};
  }
  return longest;
}

const std::atomic<bool>* ComputationWatch::StopFlag(int device) const {
  return device < 0 || device >= num_devices_ ? nullptr : &stop_[device];
}

std::optional<std::string> ComputationWatch::StopReason(int device) const {
  absl::MutexLock lock(&mu_);
  if (device < 0 || device >= num_devices_ || !devices_[device].stop_asked.has_value()) return std::nullopt;
  return devices_[device].stop_reason;
}

namespace {
std::string Overran(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit) {
  const WorkLabel& l = overrun.label;
  return absl::StrCat("device ", overrun.device, " of host ", host, " has run one computation ('", l.name, "', shard ",
                      l.shard, " of run ", l.run, " of client ", ClientLabel(l.client), ") for ",
                      absl::FormatDuration(absl::Trunc(overrun.running, absl::Milliseconds(1))),
                      ", past the worker's computation timeout of ", absl::FormatDuration(limit),
                      " (--computation-timeout-ms)");
}
}  // namespace

std::string DescribeStop(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit) {
  return absl::StrCat(Overran(host, overrun, limit),
                      ": the host asked it to stop, so its run fails (a body stops at the next turn of a loop)");
}

std::string DescribeOverrun(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit,
                            absl::Duration grace) {
  return absl::StrCat(Overran(host, overrun, limit), ", and did not stop within ", absl::FormatDuration(grace),
                      " of being asked; a device cannot be preempted, so the host leaves the cluster and its runs fail "
                      "(a supervisor starts the worker again)");
}

}  // namespace pathways
