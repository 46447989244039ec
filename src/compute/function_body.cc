#include "compute/function_body.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/sha.h"

namespace pathways {

std::string FunctionKey(const FunctionBody& body) {
  // SHA-256 of a length-prefixed encoding: hosts cache compiled functions by this key for every
  // tenant, so a tenant must not be able to make its body collide with another's (a fast
  // non-cryptographic hash would let it put its code in place of someone else's).
  const std::string encoded = absl::StrCat(static_cast<int>(body.kind), ":", body.name.size(), ":",
                                           body.name, ":", body.source);
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(encoded.data()), encoded.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

}  // namespace pathways
