#include "compute/function_body.h"

#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/sha.h"

namespace pathways {

std::string FunctionBody::DisplayName() const {
  if (!gradient) return name;
  switch (gradient->residuals) {
    case Residuals::kKeep:
      return absl::StrCat("vjp_forward(", name, ")");
    case Residuals::kUse:
      return absl::StrCat("vjp_backward(", name, ")");
    default:
      return absl::StrCat("vjp(", name, ")");
  }
}
namespace {

void AppendField(std::string& out, const std::string& field) { absl::StrAppend(&out, field.size(), ":", field); }

void AppendSpecs(std::string& out, const std::vector<std::vector<std::string>>& specs) {
  absl::StrAppend(&out, "[", specs.size());
  for (const auto& spec : specs) {
    absl::StrAppend(&out, "(", spec.size());
    for (const std::string& axis : spec) AppendField(out, axis);
  }
}

}  // namespace

std::string FunctionKey(const FunctionBody& body) {
  // SHA-256 of a length-prefixed encoding: hosts cache compiled functions by this key for every
  // tenant, so a tenant must not be able to make its body collide with another's (a fast
  // non-cryptographic hash would let it put its code in place of someone else's).
  // Every text is length-prefixed: a source ending in what a gradient's encoding appends (in a
  // comment) must not give a plain body another body's key.
  std::string encoded = absl::StrCat(static_cast<int>(body.kind), ":", body.name.size(), ":", body.name, ":",
                                     body.source.size(), ":", body.source, ":", body.source_file.size(), ":",
                                     body.source_file);
  if (body.gradient) {
    const FunctionBody::Gradient& g = *body.gradient;
    absl::StrAppend(&encoded, "|vjp", g.with_outputs ? "+" : "-", static_cast<int>(g.residuals), ":", g.wrt.size());
    for (int i : g.wrt) absl::StrAppend(&encoded, ",", i);
    AppendSpecs(encoded, g.in_specs);
    AppendSpecs(encoded, g.out_specs);
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(encoded.data()), encoded.size(), digest);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

absl::Status ValidateFunctionBody(const FunctionBody& body) {
  if (body.kind != FunctionBody::Kind::kTorchScript && body.kind != FunctionBody::Kind::kBuiltin) {
    return absl::InvalidArgumentError(absl::StrCat("unknown function body kind ", static_cast<int>(body.kind)));
  }
  if (body.name.empty()) return absl::InvalidArgumentError("a function body needs a name");
  // Its source would be part of its key (FunctionKey) though nothing reads it: one kernel could be
  // compiled again and again under keys that differ only there.
  if (body.kind == FunctionBody::Kind::kBuiltin && !body.source.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("built-in kernel '", body.name, "' takes no source"));
  }
  if (!body.gradient) return absl::OkStatus();
  const FunctionBody::Gradient& g = *body.gradient;
  if (g.residuals != FunctionBody::Residuals::kRecompute && g.residuals != FunctionBody::Residuals::kKeep &&
      g.residuals != FunctionBody::Residuals::kUse) {
    return absl::InvalidArgumentError(absl::StrCat("gradient of '", body.name, "' has an unknown residual mode ",
                                                   static_cast<int>(g.residuals)));
  }
  if (g.with_outputs && g.residuals != FunctionBody::Residuals::kRecompute) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradient of '", body.name, "': with_outputs is for a gradient that recomputes its forward pass; the forward "
        "half of a split one returns the outputs already"));
  }
  std::set<int> seen;
  for (int i : g.wrt) {
    if (i < 0 || i >= static_cast<int>(g.in_specs.size())) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of '", body.name, "' with respect to input ", i,
                                                     ", but the function has ", g.in_specs.size(), " inputs"));
    }
    if (!seen.insert(i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient of '", body.name, "' names input ", i, " twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pathways
