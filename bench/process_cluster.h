// A controller and worker processes on loopback, for benchmarks that measure real processes:
// started by Start, stopped (SIGTERM) when this goes.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench_util.h"
#include "core/status_macros.h"
#include "testing/subprocess.h"

namespace pathways::bench {

class ProcessCluster {
 public:
  // `binary` is the `pathways` program; `hosts` workers of `devices` devices each.
  absl::Status Start(const std::string& binary, int hosts, int devices, int64_t device_memory) {
    PW_RETURN_IF_ERROR(controller_.Start({binary, "controller", "--listen", "127.0.0.1:0"}));
    PW_ASSIGN_OR_RETURN(std::string line, controller_.WaitForLine("listening on", absl::Seconds(60)));
    address_ = line.substr(line.rfind(' ') + 1);
    for (int h = 0; h < hosts; ++h) {
      workers_.push_back(std::make_unique<Subprocess>());
      PW_RETURN_IF_ERROR(workers_.back()->Start({binary, "worker", "--controller", address_, "--listen", "127.0.0.1:0",
                                                 "--devices", std::to_string(devices), "--device-memory",
                                                 std::to_string(device_memory)}));
    }
    for (auto& w : workers_) PW_RETURN_IF_ERROR(w->WaitForLine("serving", absl::Seconds(60)).status());
    return absl::OkStatus();
  }
  // Each process gets SIGTERM and 30 s to exit, then SIGKILL: a benchmark never waits forever.
  ~ProcessCluster() {
    for (auto& w : workers_) w->Terminate(absl::Seconds(30));
    controller_.Terminate(absl::Seconds(30));
  }
  const std::string& address() const { return address_; }
  pid_t controller_pid() const { return controller_.pid(); }
  // CPU seconds every worker process has run so far, together.
  double WorkersCpuSeconds() const {
    double total = 0;
    for (const auto& w : workers_) total += ProcessCpuSeconds(w->pid());
    return total;
  }

 private:
  Subprocess controller_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
  std::string address_;
};

}  // namespace pathways::bench
