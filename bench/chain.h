// The chained form of a benchmark's step: one program of `length` calls of one function, each
// call's output the next one's input.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "client/program.h"
#include "core/status_macros.h"

namespace pathways::bench {

inline absl::StatusOr<Program> ChainOf(const std::string& name, const CompiledFunction& fn, const VirtualSlice& slice,
                                       const TensorSpec& spec, int length) {
  ProgramBuilder builder(name);
  TracedValue v = builder.Arg(spec);
  for (int i = 0; i < length; ++i) {
    PW_ASSIGN_OR_RETURN(auto out, builder.Call(fn, slice, {v}));
    v = out[0];
  }
  return builder.Build({v});
}

}  // namespace pathways::bench
