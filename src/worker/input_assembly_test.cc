#include "worker/input_assembly.h"

#include <cstring>
#include <numeric>

#include "device/cpu_device.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

BufferPtr Filled(Device& device, Shape shape, float first) {
  BufferPtr b = *device.Allocate(DType::kF32, shape);
  float* data = reinterpret_cast<float*>(b->data());
  std::iota(data, data + b->byte_size() / 4, first);
  return b;
}

InputPlan Plan(Shape shape, DType dtype, std::vector<Region> regions, std::vector<Shape> starts) {
  InputPlan plan;
  plan.spec = {dtype, std::move(shape)};
  plan.src_regions = std::move(regions);
  plan.dst_starts = std::move(starts);
  return plan;
}

TEST(InputAssemblyTest, PiecesLandInTheirRegions) {
  CpuDevice device(0, 1 << 20);
  // Two 2x2 blocks side by side make a 2x4 input; the second comes from a larger buffer.
  std::vector<BufferPtr> pieces = {Filled(device, {2, 2}, 0), Filled(device, {4, 4}, 100)};
  InputPlan plan = Plan({2, 4}, DType::kF32, {{{0, 0}, {2, 2}}, {{1, 1}, {2, 2}}}, {{0, 0}, {0, 2}});
  auto in = AssembleInput(device, absl::ZeroDuration(), plan, pieces);
  ASSERT_TRUE(in.ok()) << in.status();
  const float* got = reinterpret_cast<const float*>((*in)->data());
  // Row 0: 0 1 | 105 106; row 1: 2 3 | 109 110.
  EXPECT_EQ(std::vector<float>(got, got + 8), (std::vector<float>{0, 1, 105, 106, 2, 3, 109, 110}));
}

TEST(InputAssemblyTest, AWholeBufferOnTheDeviceIsUsedWithoutACopy) {
  CpuDevice device(0, 1 << 20);
  std::vector<BufferPtr> pieces = {Filled(device, {2, 2}, 0)};
  InputPlan plan = Plan({2, 2}, DType::kF32, {{{0, 0}, {2, 2}}}, {{0, 0}});
  auto in = AssembleInput(device, absl::ZeroDuration(), plan, pieces);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->get(), pieces[0].get());
}

TEST(InputAssemblyTest, PiecesThatDoNotFitAreRefused) {
  CpuDevice device(0, 1 << 20);
  std::vector<BufferPtr> pieces = {Filled(device, {2, 2}, 0)};
  InputPlan outside = Plan({2, 2}, DType::kF32, {{{1, 1}, {2, 2}}}, {{0, 0}});
  EXPECT_EQ(AssembleInput(device, absl::ZeroDuration(), outside, pieces).status().code(),
            absl::StatusCode::kInvalidArgument);
  InputPlan wrong_type = Plan({2, 2}, DType::kI32, {{{0, 0}, {2, 2}}}, {{0, 0}});
  EXPECT_EQ(AssembleInput(device, absl::ZeroDuration(), wrong_type, pieces).status().code(),
            absl::StatusCode::kInvalidArgument);
  InputPlan wrong_rank = Plan({4}, DType::kF32, {{{0, 0}, {2, 2}}}, {{0}});
  EXPECT_EQ(AssembleInput(device, absl::ZeroDuration(), wrong_rank, pieces).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pathways
