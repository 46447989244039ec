// A small command-line parser for the `pathways` subcommands: `--name value` or `--name=value`.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pathways {

class Flags {
 public:
  // Fails on a positional argument, a flag not in `known` or `switches`, or a flag in `known`
  // without a value. Switches take no value: `--print-ir` sets it.
  static absl::StatusOr<Flags> Parse(int argc, char** argv, const std::vector<std::string>& known,
                                     const std::vector<std::string>& switches = {});
  bool Has(const std::string& name) const { return values_.contains(name); }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  // HOST:PORT (an IPv6 host in brackets), the port 1..65535, or 0 too when `port_zero` (a port
  // the kernel picks, for a server).
  absl::StatusOr<std::string> GetAddress(const std::string& name, const std::string& fallback, bool port_zero) const;
  // Accepts plain bytes or a suffix: KiB, MiB, GiB (and K, M, G, KB, MB, GB as powers of 1024).
  absl::StatusOr<int64_t> GetBytes(const std::string& name, int64_t fallback) const;
  // When the flag is given: the file it names can be written (it is opened for writing without
  // being emptied, and removed again if this made it), so a run fails at start, not after its
  // work, on a path it cannot write. InvalidArgument naming the flag, the path and why.
  absl::Status CheckWritable(const std::string& name) const;
  // `--log-level` when given: the level of this process's log lines and, through the
  // environment (PATHWAYS_LOG_LEVEL), of the processes it starts. InvalidArgument naming the
  // choices for a level that is not one.
  absl::Status ApplyLogLevel() const;

 private:
  std::map<std::string, std::string> values_;
};

absl::StatusOr<int64_t> ParseBytes(const std::string& text);

}  // namespace pathways
