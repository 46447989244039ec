#include "collective/reduction.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace pathways::collective {
namespace {

// Plain loops over __restrict pointers: the compiler vectorises them, and they read each input
// once (memory bandwidth bounds them for anything but tiny arrays).
template <typename T>
void Reduce(ReduceOp op, T* __restrict acc, const T* __restrict in, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + in[i];
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], in[i]);
      return;
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], in[i]);
      return;
  }
}

void ReduceBool(ReduceOp op, uint8_t* __restrict acc, const uint8_t* __restrict in, size_t n) {
  if (op == ReduceOp::kMin) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] & in[i];
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] | in[i];
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
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

absl::Status ReduceInto(DType dtype, ReduceOp op, void* acc, const void* in, size_t count) {
  switch (dtype) {
    case DType::kF32: Reduce(op, static_cast<float*>(acc), static_cast<const float*>(in), count); break;
    case DType::kF64: Reduce(op, static_cast<double*>(acc), static_cast<const double*>(in), count); break;
    case DType::kI32: Reduce(op, static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), count); break;
    case DType::kI64: Reduce(op, static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), count); break;
    case DType::kBool: ReduceBool(op, static_cast<uint8_t*>(acc), static_cast<const uint8_t*>(in), count); break;
    default: return absl::InvalidArgumentError(absl::StrCat("cannot reduce elements of type ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

}  // namespace pathways::collective
