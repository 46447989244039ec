#include "core/types.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pathways {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kBool: return 1;
    default: return 0;
  }
}

std::string DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kBool: return "bool";
    default: return absl::StrCat("invalid_dtype(", static_cast<int>(dtype), ")");
  }
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  for (DType d : {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool}) {
    if (DTypeName(d) == name) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

bool IsValidDType(int32_t value) { return value >= 1 && value <= 5; }

std::string ShapeToString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeToString(shape), " has a negative dimension"));
    }
    if (d != 0 && n > (int64_t{1} << 62) / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeToString(shape), " has too many elements"));
    }
    n *= d;
  }
  return n;
}

absl::StatusOr<int64_t> ByteSize(DType dtype, absl::Span<const int64_t> shape, int64_t limit) {
  if (DTypeSize(dtype) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("invalid dtype ", static_cast<int>(dtype)));
  }
  auto n = NumElements(shape);
  if (!n.ok()) return n.status();
  if (*n > limit / static_cast<int64_t>(DTypeSize(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("array ", DTypeName(dtype),
                                                   ShapeToString(shape), " exceeds the ", limit,
                                                   "-byte limit on one array"));
  }
  return *n * static_cast<int64_t>(DTypeSize(dtype));
}

std::string TensorSpec::ToString() const { return DTypeName(dtype) + ShapeToString(shape); }

absl::StatusOr<HostArray> HostArray::Create(DType dtype, Shape shape) {
  auto size = ByteSize(dtype, shape);
  if (!size.ok()) return size.status();
  HostArray a;
  a.dtype_ = dtype;
  a.shape_ = std::move(shape);
  a.bytes_.assign(static_cast<size_t>(*size), '\0');
  return a;
}

absl::StatusOr<HostArray> HostArray::FromBytes(DType dtype, Shape shape, std::string bytes) {
  auto size = ByteSize(dtype, shape);
  if (!size.ok()) return size.status();
  if (static_cast<int64_t>(bytes.size()) != *size) {
    return absl::InvalidArgumentError(absl::StrCat("array ", DTypeName(dtype), ShapeToString(shape),
                                                   " needs ", *size, " bytes, got ",
                                                   bytes.size()));
  }
  HostArray a;
  a.dtype_ = dtype;
  a.shape_ = std::move(shape);
  a.bytes_ = std::move(bytes);
  return a;
}

int64_t HostArray::num_elements() const {
  auto n = NumElements(shape_);
  return n.ok() ? *n : 0;
}

}  // namespace pathways
