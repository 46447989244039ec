// What every benchmark program measures with: medians of repeated runs and wall time.
#pragma once

#include <sys/resource.h>
#include <sys/types.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/progress.h"
#include "tools/flags.h"

namespace pathways::bench {

// 1, 2, 4, ... up to `max`: the sizes most tables sweep.
inline std::vector<int> Doublings(int max) {
  std::vector<int> out;
  for (int n = 1; n <= max; n *= 2) out.push_back(n);
  return out;
}

// On a terminal, which row of a table is being measured: a bar on stderr, so the tables on
// stdout stay clean, and nothing off a terminal. Measuring(row) before a row's work, Printing()
// before its line is printed (it wipes the bar).
class RowProgress {
 public:
  RowProgress(std::string table, int64_t rows) : progress_(std::move(table), rows, stderr, Progress::OffTerminal::kSilent) {}
  void Measuring(const std::string& row) { progress_.Show(done_++, row); }
  void Printing() { progress_.Clear(); }
  // Draws the bar complete (the table is done).
  void Finished() { progress_.Show(done_); }

 private:
  Progress progress_;
  int64_t done_ = 0;
};

// The median of `v` (the upper one of an even count); 0 for none.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Wall seconds `body` takes.
inline double Seconds(const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// CPU seconds the threads of process `pid` have run, from each thread's schedstat (nanoseconds;
// /proc/PID/stat counts in clock ticks of 10 ms, too coarse for a few thousand short runs).
// Threads that have exited no longer count.
inline double ProcessCpuSeconds(pid_t pid) {
  int64_t nanos = 0;
  std::error_code error;
  for (const auto& task :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", error)) {
    std::ifstream in(task.path() / "schedstat");
    int64_t ran = 0;
    if (in >> ran) nanos += ran;
  }
  return static_cast<double>(nanos) * 1e-9;
}

// Per thread name, the nanoseconds process `pid`'s threads of that name have run and have waited
// on a run queue for a core (schedstat's first two fields); threads that have exited no longer
// count. Tells a wait for work from a wait for a core.
struct ThreadTime {
  int64_t ran_ns = 0, waited_ns = 0;
};
inline std::map<std::string, ThreadTime> ThreadTimes(pid_t pid) {
  std::map<std::string, ThreadTime> out;
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", error)) {
    std::ifstream comm(task.path() / "comm"), stat(task.path() / "schedstat");
    std::string name;
    ThreadTime t;
    if (!std::getline(comm, name) || !(stat >> t.ran_ns >> t.waited_ns)) continue;
    out[name].ran_ns += t.ran_ns;
    out[name].waited_ns += t.waited_ns;
  }
  return out;
}

// CPU seconds this process has run, user and system.
inline double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// CPU seconds the calling thread has run.
inline double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// The benchmark's flags (argv[1..]): those in `known` and `--log-level debug|info|warning|error`,
// which every benchmark takes, as every `pathways` command does (Flags::ApplyLogLevel). A bad
// flag is named on stderr and the benchmark exits with status 2.
inline Flags FlagsOrExit(int argc, char** argv, std::vector<std::string> known) {
  known.push_back("log-level");
  absl::StatusOr<Flags> flags = Flags::Parse(argc - 1, argv + 1, known);
  absl::Status status = flags.ok() ? flags->ApplyLogLevel() : flags.status();
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", std::string(status.message()).c_str());
    std::exit(2);
  }
  return *std::move(flags);
}

// The integer flag `name` (or `fallback`), which must be from `min` to `max`: a benchmark given a
// bad one says which and exits with status 2.
inline int64_t IntFlagOrExit(const Flags& flags, const std::string& name, int64_t fallback, int64_t min = 1,
                             int64_t max = int64_t{1} << 30) {
  absl::StatusOr<int64_t> value = flags.GetInt(name, fallback);
  if (value.ok() && *value >= min && *value <= max) return *value;
  const std::string why = value.ok() ? "must be from " + std::to_string(min) + " to " + std::to_string(max)
                                     : value.status().ToString();
  std::fprintf(stderr, "--%s: %s\n", name.c_str(), why.c_str());
  std::exit(2);
}

// The comma-separated integers of flag `name`, each from `min` to `max`: a benchmark given a bad
// one says which and exits with status 2.
inline std::vector<int> IntListFlagOrExit(const Flags& flags, const std::string& name, int min, int max) {
  std::vector<int> values;
  for (absl::string_view w : absl::StrSplit(flags.Get(name), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < min || n > max) {
      std::fprintf(stderr, "bad --%s '%s': want integers from %d to %d\n", name.c_str(), std::string(w).c_str(), min,
                   max);
      std::exit(2);
    }
    values.push_back(n);
  }
  return values;
}

// "HxD,HxD,...": (hosts, devices per host) pairs, at most 64 devices each. A bad one is named on
// stderr and the benchmark exits with status 2.
inline std::vector<std::pair<int, int>> ConfigsOrExit(const std::string& text) {
  std::vector<std::pair<int, int>> configs;
  for (absl::string_view c : absl::StrSplit(text, ',')) {
    std::vector<std::string> hd = absl::StrSplit(c, 'x');
    int h = 0, d = 0;
    if (hd.size() != 2 || !absl::SimpleAtoi(hd[0], &h) || !absl::SimpleAtoi(hd[1], &d) || h < 1 || d < 1 ||
        h * d > 64) {
      std::fprintf(stderr, "bad config '%s': want HOSTSxDEVICES, at most 64 devices\n", std::string(c).c_str());
      std::exit(2);
    }
    configs.push_back({h, d});
  }
  return configs;
}

// A benchmark's exit status: 1 when a measurement of this runtime (or of a peer the project builds) failed,
// so that its smoke test fails; a missing peer from Debian is no failure.
inline int ExitStatus(int failed) {
  if (failed == 0) return 0;
  std::fprintf(stderr, "%d measurements failed (above)\n", failed);
  return 1;
}

}  // namespace pathways::bench
