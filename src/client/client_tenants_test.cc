// Tenants of one cluster apart: what a client's runs leave (traces, handles, device memory) is
// not another client's to see or use.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/client_test_fixture.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST_F(ClientTest, TraceShowsEachShardOfEachComputationForItsClientOnly) {
  const absl::Time start = absl::Now();
  const TensorSpec spec{DType::kF32, {8}};
  auto traced_fn = *client_->Compile(FunctionSpec::Builtin("negate", {spec}, {spec}, {{"x"}}, {{"x"}}));
  ShardedArray x = *client_->Put(*HostArray::Create(DType::kF32, {8}), slice8_, {"x"});
  for (int i = 0; i < 3; ++i) x = (*client_->Call(traced_fn, slice8_, {x}))[0];
  ASSERT_TRUE(client_->Ready(x).Await().ok());
  auto json = client_->TraceJson(start);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(Count(*json, R"("ph":"X","name":"negate")"), 3 * 8) << *json;  // 3 calls x 8 shards
  EXPECT_NE(json->find(R"("name":"process_name")"), std::string::npos);
  EXPECT_NE(json->find(client_->id()), std::string::npos);
  auto other = *cluster_->Connect();
  auto theirs = other->TraceJson(start);
  ASSERT_TRUE(theirs.ok());
  EXPECT_EQ(Count(*theirs, R"("ph":"X")"), 0);  // another tenant sees none of it
}

TEST_F(ClientTest, ClientsCannotUseEachOthersHandles) {
  auto other = *cluster_->Connect();
  auto mine = *client_->Put(Iota({4}), island0_);
  auto fn = *other->Compile(FunctionSpec::Builtin("negate", {{DType::kF32, {4}}}, {{DType::kF32, {4}}}));
  auto their_slice = *other->CreateSlice({.mesh_shape = {4}});
  EXPECT_EQ(other->Call(fn, their_slice, {mine}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Put(Iota({4}), island0_).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Fetch(mine).Await().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Ready(mine).Await().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Enqueued(mine).Await().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Fetch(ShardedArray()).Await().status().code(), absl::StatusCode::kInvalidArgument);
}

// A client's function that reads memory it never wrote (torch.empty) finds zeros, never what
// another client's work left there: at sizes the system allocator serves and at sizes the device
// memory cache hands back.
TEST_F(ClientTest, AFunctionNeverSeesWhatAnotherClientLeftInTheDevicesMemory) {
  auto other = *cluster_->Connect();
  auto other_slice = *other->CreateSlice({.mesh_shape = {4}, .island = 0});
  for (int64_t n : {int64_t{1024}, int64_t{65536}, int64_t{1} << 20}) {
    const TensorSpec spec{DType::kF32, {n}};
    HostArray secret = *HostArray::Create(DType::kF32, {n});
    for (int64_t i = 0; i < n; ++i) secret.mutable_data<float>()[i] = 12345.0f;
    auto x = *client_->Put(secret, island0_);
    auto twice = *client_->Compile(FunctionSpec::Script(
        "twice", "def twice(x):\n    y = x * 2.0\n    return y * 0.5 + y * 0.0\n", {spec}, {spec}));
    auto out = client_->Call(twice, island0_, {x});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(client_->Fetch((*out)[0]).Await().ok());

    auto seed = *other->Put(*HostArray::Create(DType::kF32, {n}), other_slice);
    auto peek = *other->Compile(FunctionSpec::Script(
        "peek", absl::StrCat("def peek(x):\n    return torch.empty(", n, ") + x * 0.0\n"), {spec}, {spec}));
    auto seen = other->Call(peek, other_slice, {seed});
    ASSERT_TRUE(seen.ok()) << seen.status();
    auto got = other->Fetch((*seen)[0]).Await();
    ASSERT_TRUE(got.ok()) << got.status();
    int64_t nonzero = 0;
    for (int64_t i = 0; i < n; ++i) nonzero += got->data<float>()[i] != 0.0f;
    EXPECT_EQ(nonzero, 0) << n << " elements";
  }
}

}  // namespace
}  // namespace pathways
