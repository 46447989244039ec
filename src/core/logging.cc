#include "core/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"

namespace pathways {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("PATHWAYS_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  auto level = ParseLogLevel(env);
  if (!level.ok()) {
    std::fprintf(stderr, "PATHWAYS_LOG_LEVEL: %s; logging at info\n", std::string(level.status().message()).c_str());
    return LogLevel::kInfo;
  }
  return *level;
}

std::atomic<LogLevel>& Level() {
  static std::atomic<LogLevel> level{InitialLevel()};
  return level;
}

}  // namespace

LogLevel MinLogLevel() { return Level().load(std::memory_order_relaxed); }
void SetMinLogLevel(LogLevel level) { Level().store(level); }

absl::StatusOr<LogLevel> ParseLogLevel(const std::string& name) {
  static const char* kNames[] = {"debug", "info", "warning", "error"};
  const std::string lower = absl::AsciiStrToLower(name);
  for (int i = 0; i < 4; ++i) {
    if (lower == kNames[i] || lower == std::string(1, static_cast<char>('0' + i))) return static_cast<LogLevel>(i);
  }
  if (lower == "warn") return LogLevel::kWarning;
  return absl::InvalidArgumentError("log level '" + name + "' is not one of debug, info, warning, error (or 0-3)");
}

std::string FormatLogLine(LogLevel level, const char* file, int line, const std::string& message, int64_t unix_millis) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  const time_t seconds = static_cast<time_t>(unix_millis / 1000);
  struct tm utc;
  gmtime_r(&seconds, &utc);
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &utc);
  return absl::StrFormat("%c %s.%03dZ %s:%d] %s", kLetters[static_cast<int>(level)], when,
                         static_cast<int>(unix_millis % 1000), base, line, message);
}

void EmitLogLine(LogLevel level, const char* file, int line, const std::string& message) {
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const std::string text = FormatLogLine(level, file, line, message, now) + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace pathways
