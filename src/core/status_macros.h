// Status propagation helpers used across every component boundary.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PW_CONCAT_INNER(a, b) a##b
#define PW_CONCAT(a, b) PW_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define PW_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::absl::Status pw_status_ = (expr);          \
    if (!pw_status_.ok()) return pw_status_;     \
  } while (0)

// `PW_ASSIGN_OR_RETURN(auto x, MakeX());` assigns the value or returns the error.
#define PW_ASSIGN_OR_RETURN(lhs, expr) \
  PW_ASSIGN_OR_RETURN_IMPL(PW_CONCAT(pw_statusor_, __LINE__), lhs, expr)
#define PW_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()
