#include "compute/function_body.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pathways {

std::string FunctionKey(const FunctionBody& body) {
  // absl's hash is seeded per process, so two fixed FNV-1a variants over a length-prefixed
  // encoding are used instead; 128 bits make accidental collisions negligible.
  std::string encoded = absl::StrCat(static_cast<int>(body.kind), ":", body.name.size(), ":",
                                     body.name, ":", body.source);
  uint64_t h1 = 0xcbf29ce484222325ull, h2 = 0x84222325cbf29ce4ull;
  for (unsigned char c : encoded) {
    h1 = (h1 ^ c) * 0x100000001b3ull;
    h2 = (h2 ^ c) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
  }
  return absl::StrFormat("%016x%016x", h1, h2);
}

}  // namespace pathways
