#include "core/ids.h"

#include <random>

#include "absl/strings/str_format.h"

namespace pathways {

uint64_t RandomId64() {
  static thread_local std::mt19937_64 engine{std::random_device{}()};
  return engine();
}

std::string RandomIdString() { return absl::StrFormat("%016x", RandomId64()); }

std::string ClientLabel(const std::string& client_id) { return client_id.substr(0, 8); }

}  // namespace pathways
