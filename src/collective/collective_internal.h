// Internals shared by the collective hub's files (collective.cc: the meeting of a host's
// members; collective_perform.cc: what each collective does with their buffers).
#pragma once

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "collective/collective.h"

namespace pathways::collective {

// FNV-1a: tags and signatures must be the same in every process (absl::Hash is seeded per
// process).
uint64_t Fnv64(absl::string_view s);

// What a leader does when its members are not there to share work with: every part itself.
absl::Status Alone(int n, absl::FunctionRef<absl::Status(int)> part);

// A call as people read it: "all_reduce(f32[4], sum)".
std::string Describe(const CollectiveCall& c);

}  // namespace pathways::collective
