#include "collective/reduction.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace pathways::collective {
namespace {

// Plain loops over __restrict pointers: the compiler vectorises them, and they read each input
// once (memory bandwidth bounds them for anything but tiny arrays).
// `out` may alias `a` or `b` (element i is read before it is written). The operands keep their
// order: max and min are not commutative for NaN and signed zeros, so callers that must agree
// bit for bit pass them in an order they agree on.
template <typename T>
void ReduceTyped(ReduceOp op, const T* a, const T* b, T* out, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
      for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) out[i] = std::max(a[i], b[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) out[i] = std::min(a[i], b[i]);
      return;
  }
}

void ReduceBool(ReduceOp op, const uint8_t* a, const uint8_t* b, uint8_t* out, size_t n) {
  if (op == ReduceOp::kMin) {
    for (size_t i = 0; i < n; ++i) out[i] = a[i] & b[i];
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = a[i] | b[i];
  }
}

}  // namespace

absl::StatusOr<ReduceOp> ParseReduceOp(absl::string_view name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  return absl::InvalidArgumentError(absl::StrCat("unknown reduction '", name, "'; use sum, max, min or mean"));
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

absl::Status Reduce(DType dtype, ReduceOp op, const void* a, const void* b, void* out, size_t count) {
  switch (dtype) {
    case DType::kF32:
      ReduceTyped(op, static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(out), count);
      break;
    case DType::kF64:
      ReduceTyped(op, static_cast<const double*>(a), static_cast<const double*>(b), static_cast<double*>(out), count);
      break;
    case DType::kI32:
      ReduceTyped(op, static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), static_cast<int32_t*>(out),
                  count);
      break;
    case DType::kI64:
      ReduceTyped(op, static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), static_cast<int64_t*>(out),
                  count);
      break;
    case DType::kBool:
      ReduceBool(op, static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), static_cast<uint8_t*>(out), count);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("cannot reduce elements of type ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status ReduceInto(DType dtype, ReduceOp op, void* acc, const void* in, size_t count) {
  return Reduce(dtype, op, acc, in, acc, count);
}

}  // namespace pathways::collective
