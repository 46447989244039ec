// Leveled logging to stderr, the one logging library of every binary. Each line is written with
// one call (thread-safe) as `L YYYY-MM-DDTHH:MM:SS.mmmZ file:line] message`, L being D, I, W or E.
#pragma once

#include <sstream>
#include <string>

#include "absl/status/statusor.h"

namespace pathways {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Lines below this level are dropped. Defaults to kInfo, or PATHWAYS_LOG_LEVEL (a name that
// ParseLogLevel takes); the `pathways` binary's --log-level sets it.
LogLevel MinLogLevel();
// "debug", "info", "warning" (or "warn") or "error", in any case, or 0-3; InvalidArgument naming
// the choices otherwise.
absl::StatusOr<LogLevel> ParseLogLevel(const std::string& name);
// The line EmitLogLine writes, without its newline (for tests).
std::string FormatLogLine(LogLevel level, const char* file, int line, const std::string& message, int64_t unix_millis);
void SetMinLogLevel(LogLevel level);
void EmitLogLine(LogLevel level, const char* file, int line, const std::string& message);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line) : level_(level), file_(file), line_(line) {}
  ~LogMessage() { EmitLogLine(level_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Turns a stream expression into void for PW_LOG's conditional.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace pathways

// An expression, not an if statement, so it is safe after an unbraced `if`. `&` binds looser
// than `<<`, so the whole message is streamed before it is discarded.
#define PW_LOG(level)                                                            \
  (::pathways::LogLevel::k##level < ::pathways::MinLogLevel())                   \
      ? (void)0                                                                  \
      : ::pathways::LogVoidify() &                                               \
            ::pathways::LogMessage(::pathways::LogLevel::k##level, __FILE__, __LINE__).stream()
