#include "core/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace pathways {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("PATHWAYS_LOG_LEVEL");
  if (env != nullptr && env[0] >= '0' && env[0] <= '3' && env[1] == '\0') {
    return static_cast<LogLevel>(env[0] - '0');
  }
  return LogLevel::kInfo;
}

std::atomic<LogLevel>& Level() {
  static std::atomic<LogLevel> level{InitialLevel()};
  return level;
}

}  // namespace

LogLevel MinLogLevel() { return Level().load(std::memory_order_relaxed); }
void SetMinLogLevel(LogLevel level) { Level().store(level); }

void EmitLogLine(LogLevel level, const char* file, int line, const std::string& message) {
  static const char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count();
  std::fprintf(stderr, "%c%lld.%03lld %s:%d] %s\n", kLetters[static_cast<int>(level)],
               static_cast<long long>(now / 1000), static_cast<long long>(now % 1000), base, line,
               message.c_str());
}

}  // namespace pathways
