#include "tools/flags.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/logging.h"
#include "core/status_macros.h"

namespace pathways {

absl::StatusOr<Flags> Flags::Parse(int argc, char** argv, const std::vector<std::string>& known,
                                   const std::vector<std::string>& switches) {
  Flags flags;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2), value;
    if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      flags.values_[name] = "true";
      continue;
    }
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    // Named before its value is looked for: `--help` or a misspelt last flag is unknown, not short
    // of a value.
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; known: --",
                                                     absl::StrJoin(known, ", --")));
    }
    if (eq == std::string::npos) {
      if (i + 1 == argc) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      value = argv[++i];
    }
    flags.values_[name] = value;
  }
  return flags;
}

std::string Flags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

absl::StatusOr<int64_t> Flags::GetInt(const std::string& name, int64_t fallback) const {
  if (!Has(name)) return fallback;
  int64_t v;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be an integer, got '", Get(name), "'"));
  }
  return v;
}

absl::StatusOr<std::string> Flags::GetAddress(const std::string& name, const std::string& fallback,
                                             bool port_zero) const {
  const std::string address = Has(name) ? Get(name) : fallback;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be HOST:PORT, got '", address, "': ", why));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  const std::string host = address.substr(0, colon), port_text = address.substr(colon + 1);
  if (host.empty()) return bad("no host");
  if ((host.front() == '[') != (host.back() == ']') || (host.front() != '[' && host.find(':') != std::string::npos)) {
    return bad("an IPv6 host goes in brackets");
  }
  int64_t port = -1;
  if (!absl::SimpleAtoi(port_text, &port) || port < (port_zero ? 0 : 1) || port > 65535) {
    return bad(port_zero ? "the port must be 0..65535" : "the port must be 1..65535");
  }
  return address;
}

absl::StatusOr<int64_t> Flags::GetBytes(const std::string& name, int64_t fallback) const {
  if (!Has(name)) return fallback;
  auto v = ParseBytes(Get(name));
  if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", v.status().message()));
  return v;
}

absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  std::string t = absl::AsciiStrToLower(text);
  struct Suffix {
    const char* name;
    int shift;
  };
  static const Suffix kSuffixes[] = {{"kib", 10}, {"mib", 20}, {"gib", 30}, {"kb", 10}, {"mb", 20},
                                     {"gb", 30},  {"k", 10},   {"m", 20},   {"g", 30},  {"b", 0}};
  int shift = 0;
  for (const Suffix& s : kSuffixes) {
    if (absl::EndsWith(t, s.name)) {
      shift = s.shift;
      t = t.substr(0, t.size() - strlen(s.name));
      break;
    }
  }
  int64_t v;
  if (!absl::SimpleAtoi(t, &v) || v < 0 || v > (int64_t{1} << (62 - shift))) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size such as 1GiB or 512MiB"));
  }
  return v << shift;
}

absl::Status Flags::CheckWritable(const std::string& name) const {
  if (!Has(name)) return absl::OkStatus();
  const std::string path = Get(name);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  const bool made = fd >= 0;
  // Without blocking: a FIFO that has no reader yet is fine (the writer waits for one later).
  if (!made && errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == ENXIO) return absl::OkStatus();
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": cannot write ", path, ": ", std::strerror(errno)));
  }
  ::close(fd);
  if (made) ::unlink(path.c_str());
  return absl::OkStatus();
}

absl::Status Flags::ApplyLogLevel() const {
  if (!Has("log-level")) return absl::OkStatus();
  PW_ASSIGN_OR_RETURN(LogLevel level, ParseLogLevel(Get("log-level")));
  SetMinLogLevel(level);
  ::setenv("PATHWAYS_LOG_LEVEL", Get("log-level").c_str(), 1);
  return absl::OkStatus();
}

}  // namespace pathways
