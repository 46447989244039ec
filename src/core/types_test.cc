#include "core/types.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(TypesTest, ByteSizeChecksShapeAndLimits) {
  EXPECT_EQ(*ByteSize(DType::kF32, {2, 3}), 24);
  EXPECT_EQ(*ByteSize(DType::kF64, {}), 8);
  EXPECT_EQ(ByteSize(DType::kF32, {-1}).status().code(), absl::StatusCode::kInvalidArgument);
  // 2^60 elements: reported, not overflowed.
  EXPECT_EQ(ByteSize(DType::kF32, {int64_t{1} << 30, int64_t{1} << 30}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ByteSize(DType::kInvalid, {1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TypesTest, HostArrayFromBytesChecksSize) {
  auto ok = HostArray::FromVector<float>(DType::kF32, {2}, {1.0f, 2.0f});
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->data<float>()[1], 2.0f);
  auto bad = HostArray::FromBytes(DType::kF32, {3}, std::string(8, '\0'));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("needs 12 bytes"), std::string::npos);
}

TEST(TypesTest, ParseDTypeRoundTrips) {
  for (DType d : {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool}) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d);
  }
  EXPECT_FALSE(ParseDType("f16").ok());
}

}  // namespace
}  // namespace pathways
