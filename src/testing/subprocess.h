// Child processes for multi-process tests and benchmarks: start a command, read its stdout line
// by line with a deadline, stop it. Not thread-safe; one owner.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pathways {

class Subprocess {
 public:
  Subprocess() = default;
  ~Subprocess();  // kills the child (SIGKILL) if it still runs
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  // Starts argv[0] with stdin and stdout piped to us; stderr is inherited, or goes with stdout
  // after MergeStderr (for a test that reads what a child logs).
  absl::Status Start(const std::vector<std::string>& argv);
  void MergeStderr() { merge_stderr_ = true; }
  // Children started after this are killed when the thread that started them ends (the process
  // killed included): for programs whose children must not outlive them however they end.
  void KillWhenParentEnds() { die_with_parent_ = true; }
  // The same for every Subprocess of this process from now on: for a program that starts all its
  // children from its main thread (a benchmark), so that none outlives it when it is killed.
  static void KillEveryChildWhenParentEnds();
  // Writes one line to the child's stdin.
  absl::Status WriteLine(const std::string& line);
  // The child sees end of input.
  void CloseStdin();
  // The next line of the child's stdout, without the newline. DeadlineExceeded when none comes in
  // time; Unavailable when the child closed its stdout.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  // Reads lines until one contains `needle`; returns that line.
  absl::StatusOr<std::string> WaitForLine(const std::string& needle, absl::Duration timeout);
  // Sends `signal` and waits for the exit; returns the exit status as waitpid reports it.
  int Stop(int signal);
  // SIGTERM, so that the child can stop what it started (mpirun its ranks), then SIGKILL if it
  // has not exited within `grace`; returns the exit status. Never waits longer than `grace`.
  int Terminate(absl::Duration grace);
  // Waits for the process to exit by itself; returns its wait status.
  int Wait();
  // Waits up to `wait` for the process to exit by itself, then Terminate(grace): what a program
  // that must end in bounded time does with a child that should be finishing.
  int WaitOrTerminate(absl::Duration wait, absl::Duration grace = absl::Seconds(5));
  // Waits up to `timeout` for the child to exit: its wait status, or DeadlineExceeded (it still
  // runs).
  absl::StatusOr<int> WaitFor(absl::Duration timeout);
  // Every thread's stack, from gdb when it is installed (else a line saying it is not): what a
  // test prints about a child that hangs, before it kills it.
  std::string StackTraces(absl::Duration timeout = absl::Seconds(60)) const;
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool die_with_parent_ = false;
  bool merge_stderr_ = false;
  int stdout_fd_ = -1;
  int stdin_fd_ = -1;
  std::string buffer_;
};

// Starts a `pathways controller` (or worker) from `argv` (the whole command line, which may start
// with a wrapper such as prlimit) and waits for it to say it serves: the address it listens on.
absl::StatusOr<std::string> StartController(Subprocess& process, const std::vector<std::string>& argv,
                                            absl::Duration timeout = absl::Seconds(60));
absl::StatusOr<std::string> StartWorker(Subprocess& process, const std::vector<std::string>& argv,
                                        absl::Duration timeout = absl::Seconds(60));

// Runs a command to completion and returns its stdout (bounded by `timeout`: past it the command
// gets SIGTERM, then SIGKILL 10 s later, and the result is DeadlineExceeded).
absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv, absl::Duration timeout);

// Runs `command` with /bin/sh, its stderr into its stdout, to completion: its wait status and
// everything it printed. Killed once `timeout` passes.
std::pair<int, std::string> RunShell(const std::string& command, absl::Duration timeout);

}  // namespace pathways
