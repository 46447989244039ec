// What each device of a host computes now, and since when: how a host tells that a device stopped
// making progress although the process answers heartbeats.
#pragma once

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
// with the memory and collective waits it makes, each bounded by its own timeout. Thread-safe.
class ComputationWatch {
 public:
  explicit ComputationWatch(int num_devices);

  // Device `device` starts or ends a computation (the device's own thread; one at a time).
  void Begin(int device, WorkLabel label, absl::Time now);
  void End(int device);

  struct Overrun {
    int device = -1;
    WorkLabel label;
    absl::Duration running;
  };
  // The computation running longest, when it has run longer than `limit`.
  std::optional<Overrun> LongerThan(absl::Duration limit, absl::Time now) const;

 private:
  struct Running {
    bool busy = false;
    WorkLabel label;
    absl::Time since;
  };
  mutable absl::Mutex mu_;
  std::vector<Running> devices_ ABSL_GUARDED_BY(mu_);
};

// What a host says when it leaves because of `overrun`: the device, the computation (its client
// by label) and how long it ran against `limit`.
std::string DescribeOverrun(const std::string& host, const ComputationWatch::Overrun& overrun, absl::Duration limit);

}  // namespace pathways
