// The step of the paper's Figures 5 and 6 as TorchScript, shared by collective_bench and the
// multi-controller peer so that both run the same kernels: an all_reduce(max) of the input, then
// an add in place, each step's result feeding the next. With `work` > 0 a step also multiplies two
// work x work matrices (Figure 6's computation of growing duration); the product's one element
// it reads is multiplied by 0, so the values, and the check on them, stay exact.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace pathways::bench {

inline std::string StepStatements(int work, const std::string& indent) {
  std::string body;
  if (work > 0) {
    // From the input, so that TorchScript cannot fold the product into a constant at compile time.
    absl::StrAppend(&body, indent, "m = torch.full([", work, ", ", work, "], 0.5) + x[0] * 0.0\n", indent,
                    "m = torch.mm(m, m)\n");
  }
  // The add is in place, as the peers' are (MPI's loop, torch.distributed's add_): the all_reduce's
  // result is a fresh tensor (or, once the loop carries one, the same one reduced in place).
  absl::StrAppend(&body, indent, "x = pathways.all_reduce(x, 'x', 'max').add_(1.0)\n");
  if (work > 0) absl::StrAppend(&body, indent, "x.add_(m[0, 0] * 0.0)\n");
  return body;
}

// `def step(x)`: one step.
inline std::string StepSource(int work) {
  return absl::StrCat("def step(x):\n", StepStatements(work, "    "), "    return x\n");
}

// `def fused(x)`: `steps` steps in one body.
inline std::string FusedSource(int steps, int work) {
  return absl::StrCat("def fused(x):\n    for _ in range(", steps, "):\n", StepStatements(work, "        "),
                      "    return x\n");
}

// Steps per run: enough that a run is not all start-up (its dispatch and the wait for its
// result, which the peers' loops do not pay: with 8 steps of 4 MiB, as before 2026-12-05, a
// Fused step took 10-20% longer than the multi-controller loop's), few enough for long matrix
// products (about 2^27 multiply-adds of them per run, and never fewer than 8 steps).
inline int StepsFor(int64_t bytes, int work = 0) {
  int steps = bytes <= 4096 ? 128 : 32;
  if (work > 0) {
    const int64_t per_step = static_cast<int64_t>(work) * work * work;
    steps = static_cast<int>(std::clamp<int64_t>((int64_t{1} << 27) / per_step, 8, steps));
  }
  return steps;
}

}  // namespace pathways::bench
