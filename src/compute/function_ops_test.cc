#include "compute/function_ops.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

using ::testing::HasSubstr;

TEST(FunctionOpsTest, VettedAllowsItsListTheirInPlaceFormsTheLanguageAndOurOps) {
  for (const char* op : {"matmul", "add", "add_", "index_put_", "__getitem__", "_set_item", "__range_length",
                         "layer_norm", "cross_entropy_loss", "unsafe_split"}) {
    EXPECT_EQ(RefusedOp("aten", op, FunctionOps::kVetted), "") << op;
  }
  EXPECT_EQ(RefusedOp("prim", "Loop", FunctionOps::kVetted), "");
  EXPECT_EQ(RefusedOp("pathways", "all_reduce", FunctionOps::kVetted), "");
}

TEST(FunctionOpsTest, VettedRefusesPublicOpsNobodyTriedAndSaysHowToAllowThem) {
  for (const char* op :
       {"stft", "fft_fft", "kaiser_window", "embedding_bag", "upsample_nearest2d", "ljust", "resize_", "random_"}) {
    EXPECT_THAT(RefusedOp("aten", op, FunctionOps::kVetted), HasSubstr("--function-ops public")) << op;
    EXPECT_EQ(RefusedOp("aten", op, FunctionOps::kPublic), "") << op;
  }
}

TEST(FunctionOpsTest, BothPoliciesRefuseInternalOpsFilesSeedsAndOpsKnownToTrustTheirArguments) {
  for (FunctionOps ops : {FunctionOps::kVetted, FunctionOps::kPublic}) {
    for (const char* op : {"_cummax_helper", "native_batch_norm", "max_pool2d_with_indices_backward",
                           "_sparse_coo_tensor_unsafe", "sparse_coo_tensor", "as_strided", "lu_unpack", "pixel_shuffle",
                           "__interpolate", "__upsample_bilinear", "set_", "slow_conv3d"}) {
      EXPECT_THAT(RefusedOp("aten", op, ops), HasSubstr("outside its tensors")) << op;
    }
    EXPECT_THAT(RefusedOp("aten", "from_file", ops), HasSubstr("files"));
    EXPECT_THAT(RefusedOp("aten", "manual_seed", ops), HasSubstr("generator"));
    EXPECT_THAT(RefusedOp("prim", "Print", ops), HasSubstr("log"));
    EXPECT_THAT(RefusedOp("prim", "rpc_async", ops), HasSubstr("other processes"));
    for (const char* op : {"fork", "awaitable", "awaitable_wait"}) {
      EXPECT_THAT(RefusedOp("prim", op, ops), HasSubstr("another thread")) << op;
    }
    EXPECT_THAT(RefusedOp("aten", "wait", ops), HasSubstr("another thread"));
    EXPECT_THAT(RefusedOp("quantized", "add", ops), HasSubstr("aten, prim and pathways"));
  }
}

TEST(FunctionOpsTest, NoRefusalOfBothPoliciesHidesInTheVettedList) {
  const std::vector<std::string> vetted = VettedOps();
  EXPECT_GT(vetted.size(), 400u);
  EXPECT_TRUE(std::is_sorted(vetted.begin(), vetted.end()));
  for (const std::string& op : vetted) EXPECT_EQ(RefusedOp("aten", op, FunctionOps::kPublic), "") << op;
}

TEST(FunctionOpsTest, PoliciesParseByNameAndAnUnknownOneNamesTheKnown) {
  EXPECT_EQ(*ParseFunctionOps("vetted"), FunctionOps::kVetted);
  EXPECT_EQ(*ParseFunctionOps("public"), FunctionOps::kPublic);
  EXPECT_STREQ(FunctionOpsName(FunctionOps::kPublic), "public");
  auto bad = ParseFunctionOps("all");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'all'; known: vetted (the default), public"));
}

}  // namespace
}  // namespace pathways
