// What each device of a host computes now, and since when: how a host tells that a device stopped
// making progress although the process answers heartbeats, and asks the computation to stop.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "device/device.h"

namespace pathways {

// A device's stream is non-preemptible: a computation that never ends (a body that loops forever,
// a kernel that hangs) holds every later item of the stream, and so every later gang of its
// island that uses the device. Liveness on heartbeats alone does not see it (the process answers);
// this does. A computation here is a stream item's work once its inputs are there: the kernel,
// with the memory and collective waits it makes, each bounded by its own timeout.
//
// A computation past its limit is asked to stop: each device has a flag its thread polls
// (compute/stop_request.h), at each turn of a TorchScript loop. One that does not poll (a single
// long kernel) is still running a grace period later, and then only leaving frees the host.
// Thread-safe.
class ComputationWatch {
 public:
  explicit ComputationWatch(int num_devices);

  // Device `device` starts or ends a computation (the device's own thread; one at a time). Begin
  // clears the device's stop request.
  void Begin(int device, WorkLabel label, absl::Time now);
  void End(int device);

  struct Overrun {
    int device = -1;
    WorkLabel label;
    absl::Duration running;
  };
  // Asks every computation running longer than `limit` and not asked yet to stop, with
  // `why(overrun)` as the reason its run fails; returns those asked now.
  std::vector<Overrun> StopLongerThan(absl::Duration limit, absl::Time now,
                                      const std::function<std::string(const Overrun&)>& why);
  // The computation running longest of those asked to stop at least `grace` before `now`.
  std::optional<Overrun> NotStopped(absl::Duration grace, absl::Time now) const;

  // The flag device `device`'s computations poll (ScopedStopRequest); nullptr for a device it
  // does not have. It lives as long as the watch.
  const std::atomic<bool>* StopFlag(int device) const;
  // Why the device's computation was asked to stop; none when it was not (read by its own thread
  // before End).
  std::optional<std::string> StopReason(int device) const;

 private:
  struct Running {
    bool busy = false;
    WorkLabel label;
    absl::Time since;
    std::optional<absl::Time> stop_asked;
    std::string stop_reason;
  };
  const int num_devices_;
  const std::unique_ptr<std::atomic<bool>[]> stop_;  // per device; read by its thread without mu_
  mutable absl::Mutex mu_;
  std::vector<Running> devices_ ABSL_GUARDED_BY(mu_);
};

// Why a host stops `overrun`: the device, the computation (its client by label) and how long it
// ran against `limit`.
std::string DescribeStop(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit);
// What a host says when it leaves because `overrun` did not stop within `grace` of being asked.
std::string DescribeOverrun(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit,
                            absl::Duration grace);

}  // namespace pathways
