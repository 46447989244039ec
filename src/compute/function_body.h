// What a compiled function's body is, in a form that crosses process boundaries. Torch-free, so
// the client library can name bodies without linking the compute layer.
#pragma once

#include <string>

namespace pathways {

struct FunctionBody {
  enum class Kind { kTorchScript = 0, kBuiltin = 1 };
  Kind kind = Kind::kBuiltin;
  std::string name;    // the function's name; for TorchScript, the `def` to call
  std::string source;  // TorchScript source; empty for built-ins
};

// Stable content hash of a body, as hex. Equal bodies get equal keys in every process, so a
// worker compiles each body once whoever sends it.
std::string FunctionKey(const FunctionBody& body);

}  // namespace pathways
