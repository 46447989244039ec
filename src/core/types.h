// Element types, shapes and host-resident arrays. No backend types appear here: a buffer is
// bytes, a shape and a dtype, and the compute layer views it as a tensor without copying.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pathways {

enum class DType : int32_t { kInvalid = 0, kF32 = 1, kF64 = 2, kI32 = 3, kI64 = 4, kBool = 5 };

using Shape = std::vector<int64_t>;

// Bytes per element; 0 for kInvalid or a value outside the enum.
size_t DTypeSize(DType dtype);
std::string DTypeName(DType dtype);
absl::StatusOr<DType> ParseDType(const std::string& name);
bool IsValidDType(int32_t value);

std::string ShapeToString(absl::Span<const int64_t> shape);
// Number of elements, or InvalidArgument for a negative dimension or an overflowing product.
absl::StatusOr<int64_t> NumElements(absl::Span<const int64_t> shape);
// Size in bytes, or InvalidArgument when the shape or dtype is bad or the size exceeds `limit`.
absl::StatusOr<int64_t> ByteSize(DType dtype, absl::Span<const int64_t> shape,
                                 int64_t limit = int64_t{1} << 40);

// Static description of one array: what a compiled function's signature is made of.
struct TensorSpec {
  DType dtype = DType::kInvalid;
  Shape shape;
  bool operator==(const TensorSpec&) const = default;
  std::string ToString() const;
};

// A dense row-major array in host memory. Owns its bytes; copyable.
class HostArray {
 public:
  HostArray() = default;
  // Zero-filled. Fails on a bad shape or dtype.
  static absl::StatusOr<HostArray> Create(DType dtype, Shape shape);
  // Takes `bytes`, which must hold exactly the array's size.
  static absl::StatusOr<HostArray> FromBytes(DType dtype, Shape shape, std::string bytes);
  template <typename T>
  static absl::StatusOr<HostArray> FromVector(DType dtype, Shape shape, const std::vector<T>& v) {
    if (sizeof(T) != DTypeSize(dtype)) return absl::InvalidArgumentError("element size mismatch");
    return FromBytes(dtype, std::move(shape),
                     std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)));
  }

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  TensorSpec spec() const { return {dtype_, shape_}; }
  int64_t num_elements() const;
  const std::string& bytes() const { return bytes_; }
  std::string& mutable_bytes() { return bytes_; }
  template <typename T>
  const T* data() const { return reinterpret_cast<const T*>(bytes_.data()); }
  template <typename T>
  T* mutable_data() { return reinterpret_cast<T*>(bytes_.data()); }

 private:
  DType dtype_ = DType::kInvalid;
  Shape shape_;
  std::string bytes_;
};

}  // namespace pathways
