#include "testing/subprocess.h"

#include <sys/prctl.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pathways {
namespace {
std::atomic<bool> every_child_dies_with_parent{false};
}  // namespace

void Subprocess::KillEveryChildWhenParentEnds() { every_child_dies_with_parent = true; }

Subprocess::~Subprocess() {
  if (pid_ > 0) Stop(SIGKILL);
  if (stdout_fd_ >= 0) close(stdout_fd_);
  CloseStdin();
}

absl::Status Subprocess::WriteLine(const std::string& line) {
  std::string data = line + "\n";
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(stdin_fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError(absl::StrCat("write to child: ", strerror(errno)));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

void Subprocess::CloseStdin() {
  if (stdin_fd_ >= 0) close(stdin_fd_);
  stdin_fd_ = -1;
}

absl::Status Subprocess::Start(const std::vector<std::string>& argv) {
  signal(SIGPIPE, SIG_IGN);  // a child that exits early must fail a write, not kill us
  // exec_fds: closed by the exec (O_CLOEXEC), so that the parent knows when the child runs the
  // program, or reads why it could not.
  int fds[2] = {-1, -1}, in_fds[2] = {-1, -1}, exec_fds[2] = {-1, -1};
  auto close_all = [&] {
    for (int fd : {fds[0], fds[1], in_fds[0], in_fds[1], exec_fds[0], exec_fds[1]}) {
      if (fd >= 0) close(fd);
    }
  };
  if (pipe2(fds, O_CLOEXEC) != 0 || pipe2(in_fds, O_CLOEXEC) != 0 || pipe2(exec_fds, O_CLOEXEC) != 0) {
    const int error = errno;
    close_all();
    return absl::InternalError(absl::StrCat("pipe: ", strerror(error)));
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const bool die_with_parent = die_with_parent_ || every_child_dies_with_parent.load();
  pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close_all();
    return absl::InternalError(absl::StrCat("fork: ", strerror(error)));
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    if (merge_stderr_) dup2(fds[1], STDERR_FILENO);
    dup2(in_fds[0], STDIN_FILENO);
    // The parent may block SIGINT/SIGTERM; the child must not inherit that.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent died before the request took hold
    }
    execv(args[0], args.data());
    const int error = errno;
    (void)!write(exec_fds[1], &error, sizeof(error));
    _exit(127);
  }
  close(fds[1]);
  close(in_fds[0]);
  close(exec_fds[1]);
  // Returns once the child runs the program: by then it has asked to die with this thread (a
  // thread that ended before the request took hold would not be noticed, since the child would
  // be handed to another thread of this process), and a program that cannot run is said so.
  int error = 0;
  ssize_t n;
  do {
    n = read(exec_fds[0], &error, sizeof(error));
  } while (n < 0 && errno == EINTR);
  close(exec_fds[0]);
  if (n == static_cast<ssize_t>(sizeof(error))) {
    close(fds[0]);
    close(in_fds[1]);
    waitpid(pid, nullptr, 0);
    return absl::InvalidArgumentError(absl::StrCat("cannot run ", argv.empty() ? "" : argv[0], ": ", strerror(error)));
  }
  pid_ = pid;
  stdout_fd_ = fds[0];
  stdin_fd_ = in_fds[1];
  return absl::OkStatus();
}

absl::StatusOr<std::string> Subprocess::ReadLine(absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError("no line from child process in time");
    pollfd p{stdout_fd_, POLLIN, 0};
    int r = poll(&p, 1, static_cast<int>(ms));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;
    char chunk[4096];
    ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::UnavailableError("child process closed its output");
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> Subprocess::WaitForLine(const std::string& needle, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto line = ReadLine(deadline - absl::Now());
    if (!line.ok()) return line.status();
    if (line->find(needle) != std::string::npos) return line;
  }
}

int Subprocess::Wait() { return Stop(0); }

absl::StatusOr<int> Subprocess::WaitFor(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("no child");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return status;
    }
    if (r < 0 && errno != EINTR) return absl::InternalError("waitpid failed");
    if (absl::Now() >= deadline) return absl::DeadlineExceededError("the child still runs");
    absl::SleepFor(absl::Milliseconds(20));  // a child's exit has no descriptor to wait on here
  }
}

int Subprocess::Terminate(absl::Duration grace) {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  absl::StatusOr<int> status = WaitFor(grace);
  return status.ok() ? *status : Stop(SIGKILL);
}

int Subprocess::WaitOrTerminate(absl::Duration wait, absl::Duration grace) {
  absl::StatusOr<int> status = WaitFor(wait);
  return status.ok() ? *status : Terminate(grace);
}

int Subprocess::Stop(int signal) {
  if (pid_ <= 0) return -1;
  if (signal != 0) kill(pid_, signal);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  return status;
}

std::string Subprocess::StackTraces(absl::Duration timeout) const {
  if (pid_ <= 0) return "(no child)";
  constexpr char kGdb[] = "/usr/bin/gdb";
  if (access(kGdb, X_OK) != 0) return "(no stacks: gdb is not installed)";
  auto out = RunCommand({kGdb, "-batch", "-nx", "-p", absl::StrCat(pid_), "-ex", "thread apply all bt 30"}, timeout);
  return out.ok() ? *out : absl::StrCat("(no stacks: ", out.status().ToString(), ")");
}

absl::StatusOr<std::string> RunCommand(const std::vector<std::string>& argv, absl::Duration timeout) {
  Subprocess p;
  if (absl::Status s = p.Start(argv); !s.ok()) return s;
  std::string out;
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto line = p.ReadLine(deadline - absl::Now());
    if (line.ok()) {
      absl::StrAppend(&out, *line, "\n");
      continue;
    }
    if (absl::IsUnavailable(line.status())) break;  // the command finished its output
    p.Terminate(absl::Seconds(10));  // past the deadline: a launcher (mpirun) stops its ranks first
    return line.status();
  }
  p.Stop(SIGKILL);  // already exited; reaps it
  return out;
}

absl::StatusOr<std::string> StartController(Subprocess& process, const std::vector<std::string>& argv,
                                            absl::Duration timeout) {
  if (absl::Status s = process.Start(argv); !s.ok()) return s;
  absl::StatusOr<std::string> line = process.WaitForLine("listening on", timeout);  // "... listening on ADDR"
  if (!line.ok()) return line.status();
  return line->substr(line->rfind(' ') + 1);
}

absl::StatusOr<std::string> StartWorker(Subprocess& process, const std::vector<std::string>& argv,
                                        absl::Duration timeout) {
  if (absl::Status s = process.Start(argv); !s.ok()) return s;
  absl::StatusOr<std::string> line = process.WaitForLine("serving", timeout);  // "worker ADDR serving ..."
  if (!line.ok()) return line.status();
  const size_t start = line->find("worker ") + 7;
  return line->substr(start, line->find(' ', start) - start);
}

std::pair<int, std::string> RunShell(const std::string& command, absl::Duration timeout) {
  Subprocess p;
  if (absl::Status s = p.Start({"/bin/sh", "-c", command + " 2>&1"}); !s.ok()) return {-1, s.ToString()};
  std::string out;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto line = p.ReadLine(deadline - absl::Now());
    if (!line.ok()) break;
    absl::StrAppend(&out, *line, "\n");
  }
  if (absl::Now() >= deadline) return {p.Stop(SIGKILL), out};
  return {p.Wait(), out};
}

}  // namespace pathways
