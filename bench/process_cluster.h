// A controller and worker processes on loopback, for benchmarks that measure real processes:
// started by Start, stopped (SIGTERM) when this goes.
#pragma once

#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
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

// Runs `ranks` processes of a peer program that meet through a fresh temporary directory
// (`argv(rank, dir)` is each one's command line): the first `lines` lines rank 0 prints, each
// within `timeout`. Every process is then given 60 s to exit by itself before it is ended, and
// the directory is removed. Fails naming the rank that did not start or did not exit with status
// 0, or when rank 0 printed fewer lines.
inline absl::StatusOr<std::vector<std::string>> RunPeerRanks(
    int ranks, const std::function<std::vector<std::string>(int rank, const std::string& dir)>& argv, int lines,
    absl::Duration timeout) {
  char dir_template[] = "/tmp/pathways_peers_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a directory for the peers");
  const std::string dir = dir_template;
  std::vector<std::unique_ptr<Subprocess>> procs;
  absl::Status status;
  for (int r = 0; r < ranks && status.ok(); ++r) {
    procs.push_back(std::make_unique<Subprocess>());
    status = procs.back()->Start(argv(r, dir));
    if (!status.ok()) status = absl::Status(status.code(), absl::StrCat("peer rank ", r, ": ", status.message()));
  }
  std::vector<std::string> out;
  while (status.ok() && static_cast<int>(out.size()) < lines) {
    absl::StatusOr<std::string> line = procs[0]->ReadLine(timeout);
    if (!line.ok()) {
      status = absl::Status(line.status().code(), absl::StrCat("peer rank 0 printed ", out.size(), " of ", lines,
                                                               " lines: ", line.status().message()));
      break;
    }
    out.push_back(*std::move(line));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (size_t r = 0; r < procs.size(); ++r) {
    const int wait = procs[r]->WaitOrTerminate(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (status.ok() && !(WIFEXITED(wait) && WEXITSTATUS(wait) == 0)) {
      status =
          absl::InternalError(absl::StrCat("peer rank ", r, " did not exit with status 0 (wait status ", wait, ")"));
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (!status.ok()) return status;
  return out;
}

}  // namespace pathways::bench
