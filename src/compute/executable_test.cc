#include "compute/executable.h"

#include <cstring>

#include "device/cpu_device.h"
#include "gtest/gtest.h"

namespace pathways {
namespace {

class ExecutableTest : public ::testing::Test {
 protected:
  BufferPtr MakeF32(const Shape& shape, std::vector<float> values) {
    BufferPtr b = *device_.Allocate(DType::kF32, shape);
    std::memcpy(b->data(), values.data(), values.size() * sizeof(float));
    return b;
  }
  std::vector<float> Values(const DeviceBuffer& b) {
    const float* p = reinterpret_cast<const float*>(b.data());
    return std::vector<float>(p, p + b.byte_size() / sizeof(float));
  }
  CpuDevice device_{0, 1 << 20};
  FunctionCache cache_;
};

TEST_F(ExecutableTest, BuiltinKernelRuns) {
  auto exe = cache_.Compile({FunctionBody::Kind::kBuiltin, "add_one", ""});
  ASSERT_TRUE(exe.ok()) << exe.status();
  BufferPtr in = MakeF32({3}, {1, 2, 3});
  BufferPtr out = *device_.Allocate(DType::kF32, {3});
  DeviceBuffer* outs[] = {out.get()};
  const DeviceBuffer* ins[] = {in.get()};
  ASSERT_TRUE((*exe)->Run(ins, outs).ok());
  EXPECT_EQ(Values(*out), (std::vector<float>{2, 3, 4}));
}

TEST_F(ExecutableTest, TorchScriptRunsAndIsCachedByContent) {
  FunctionBody body{FunctionBody::Kind::kTorchScript, "mm_relu",
                    "def mm_relu(a, b):\n    return torch.relu(a @ b), a + 1\n"};
  auto exe = cache_.Compile(body);
  ASSERT_TRUE(exe.ok()) << exe.status();
  auto again = cache_.Compile(body);
  EXPECT_EQ(exe->get(), again->get());
  EXPECT_EQ(cache_.size(), 1u);
  EXPECT_EQ(cache_.Lookup(FunctionKey(body)).get(), exe->get());

  BufferPtr a = MakeF32({2, 2}, {1, -2, 3, 4});
  BufferPtr b = MakeF32({2, 2}, {1, 0, 0, 1});
  BufferPtr o1 = *device_.Allocate(DType::kF32, {2, 2});
  BufferPtr o2 = *device_.Allocate(DType::kF32, {2, 2});
  const DeviceBuffer* ins[] = {a.get(), b.get()};
  DeviceBuffer* outs[] = {o1.get(), o2.get()};
  ASSERT_TRUE((*exe)->Run(ins, outs).ok());
  EXPECT_EQ(Values(*o1), (std::vector<float>{1, 0, 3, 4}));
  EXPECT_EQ(Values(*o2), (std::vector<float>{2, -1, 4, 5}));
}

TEST_F(ExecutableTest, SyntaxErrorNamesFunctionAndLine) {
  auto exe = cache_.Compile({FunctionBody::Kind::kTorchScript, "broken",
                             "def broken(x):\n    y = x + )\n    return y\n"});
  ASSERT_EQ(exe.status().code(), absl::StatusCode::kInvalidArgument);
  std::string msg(exe.status().message());
  EXPECT_NE(msg.find("'broken'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;
}

TEST_F(ExecutableTest, TypeErrorIsReported) {
  auto exe = cache_.Compile({FunctionBody::Kind::kTorchScript, "typed",
                             "def typed(x):\n    return x + 'a'\n"});
  ASSERT_FALSE(exe.ok());
  EXPECT_NE(exe.status().message().find("'typed'"), std::string::npos) << exe.status();
}

TEST_F(ExecutableTest, UnknownBuiltinAndMissingDef) {
  EXPECT_EQ(cache_.Compile({FunctionBody::Kind::kBuiltin, "nope", ""}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(
      cache_.Compile({FunctionBody::Kind::kTorchScript, "g", "def f(x):\n    return x\n"}).ok());
}

TEST_F(ExecutableTest, WrongOutputShapeAndRuntimeErrorsAreStatuses) {
  auto exe = *cache_.Compile({FunctionBody::Kind::kBuiltin, "sum", ""});
  BufferPtr in = MakeF32({2}, {1, 2});
  BufferPtr wrong = *device_.Allocate(DType::kF32, {2});
  const DeviceBuffer* ins[] = {in.get()};
  DeviceBuffer* outs[] = {wrong.get()};
  absl::Status s = exe->Run(ins, outs);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'sum' output 0"), std::string::npos) << s;

  auto mm = *cache_.Compile({FunctionBody::Kind::kBuiltin, "matmul", ""});
  BufferPtr a = MakeF32({2}, {1, 2});
  BufferPtr b = MakeF32({3}, {1, 2, 3});
  BufferPtr o = *device_.Allocate(DType::kF32, {});
  const DeviceBuffer* mm_ins[] = {a.get(), b.get()};
  DeviceBuffer* mm_outs[] = {o.get()};
  s = mm->Run(mm_ins, mm_outs);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'matmul' failed at run time"), std::string::npos) << s;
}

}  // namespace
}  // namespace pathways
