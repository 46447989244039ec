// Compiling and running bodies: built-in kernels, TorchScript, errors, gradients, residuals and
// kernels' memory. What keeps a tenant's body within its own tensors, time and memory is in
// body_confinement_test.cc (the same binary and fixture).
#include "compute/executable.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compute/body_heap.h"
#include "compute/executable_test_fixture.h"

namespace pathways {

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

// A TorchScript body that raises as it runs is the user's error (InvalidArgument), and its
// traceback names the file the source came from, at the file's line.
TEST_F(ExecutableTest, ABodysRunTimeErrorNamesItsFileAndLine) {
  FunctionBody body{FunctionBody::Kind::kTorchScript, "mixed",
                    "\n\ndef mixed(v):\n    return torch.mm(v, v.double())\n"};
  body.source_file = "/home/me/model.py";
  auto exe = cache_.Compile(body);
  ASSERT_TRUE(exe.ok()) << exe.status();
  BufferPtr in = MakeF32({2, 2}, {1, 2, 3, 4});
  BufferPtr out = *device_.Allocate(DType::kF32, {2, 2});
  const DeviceBuffer* ins[] = {in.get()};
  DeviceBuffer* outs[] = {out.get()};
  absl::Status s = (*exe)->Run(ins, outs);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("File \"/home/me/model.py\", line 4"), std::string::npos) << s;
  // A body compiled without a file says "<string>"; the two are different functions.
  FunctionBody unnamed = body;
  unnamed.source_file.clear();
  EXPECT_NE(FunctionKey(body), FunctionKey(unnamed));
  auto bad = cache_.Compile({FunctionBody::Kind::kTorchScript, "f", "def f(v):\n    return v +\n", std::nullopt,
                             "/home/me/broken.py"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("/home/me/broken.py"), std::string::npos) << bad.status();
}

// f(a, b, n) = (tanh(a) * b, sum(a)); n is an integer input with no gradient.
static constexpr char kTanhSource[] = "def f(a, b, n):\n    return torch.tanh(a) * b, a.sum() + n.sum().float()\n";

static FunctionBody TanhGradient(std::vector<int> wrt, bool with_outputs) {
  FunctionBody body{FunctionBody::Kind::kTorchScript, "f", kTanhSource};
  body.gradient = FunctionBody::Gradient{wrt, {{}, {}, {}}, {{}, {}}, with_outputs};
  return body;
}

// f's inputs, cotangents and output buffers, and the check of its product worked out by hand:
// d/da = dy * b * (1 - tanh(a)^2) + ds, d/db = dy * tanh(a).
struct TanhCase {
  const std::vector<float> a = {0.5f, -1, 2}, b = {3, 1, -2}, dy = {1, -0.5f, 2};
  const float ds = 0.25f;
  BufferPtr ba, bb, n, dy1, dy2, y1, y2, da, db;

  void ExpectProduct() const {
    for (int i = 0; i < 3; ++i) {
      const float t = std::tanh(a[i]);
      EXPECT_NEAR(Values(*y1)[i], t * b[i], 1e-6);
      EXPECT_NEAR(Values(*da)[i], dy[i] * b[i] * (1 - t * t) + ds, 1e-5) << i;
      EXPECT_NEAR(Values(*db)[i], dy[i] * t, 1e-5) << i;
    }
    EXPECT_NEAR(Values(*y2)[0], 1.5f, 1e-6);
  }
};

TanhCase ExecutableTest::MakeTanhCase() {
  TanhCase c;
  c.ba = MakeF32({3}, c.a);
  c.bb = MakeF32({3}, c.b);
  c.dy1 = MakeF32({3}, c.dy);
  c.dy2 = MakeF32({}, {c.ds});
  c.n = *device_.Allocate(DType::kI32, {2});
  std::memset(c.n->data(), 0, 8);
  c.y1 = *device_.Allocate(DType::kF32, {3});
  c.y2 = *device_.Allocate(DType::kF32, {});
  c.da = *device_.Allocate(DType::kF32, {3});
  c.db = *device_.Allocate(DType::kF32, {3});
  return c;
}

namespace {

TEST_F(ExecutableTest, GradientMatchesTheDerivativeWorkedOutByHand) {
  auto exe = cache_.Compile(TanhGradient({0, 1}, /*with_outputs=*/true));
  ASSERT_TRUE(exe.ok()) << exe.status();
  EXPECT_NE(FunctionKey(TanhGradient({0, 1}, true)), FunctionKey(TanhGradient({0, 1}, false)));
  EXPECT_NE(FunctionKey(TanhGradient({0, 1}, true)), FunctionKey({FunctionBody::Kind::kTorchScript, "f", kTanhSource}));
  // A plain body whose source ends in exactly what a gradient's key encodes after its source
  // (wrt, then the specs) does not take the gradient's key: the source is length-prefixed.
  const std::string forged = std::string(kTanhSource) + "|vjp+0:2,0,1[3(0(0(0[2(0(0";
  EXPECT_NE(FunctionKey(TanhGradient({0, 1}, true)), FunctionKey({FunctionBody::Kind::kTorchScript, "f", forged}));
  TanhCase c = MakeTanhCase();
  const DeviceBuffer* ins[] = {c.ba.get(), c.bb.get(), c.n.get(), c.dy1.get(), c.dy2.get()};
  DeviceBuffer* outs[] = {c.y1.get(), c.y2.get(), c.da.get(), c.db.get()};
  ASSERT_TRUE((*exe)->Run(ins, outs).ok());
  c.ExpectProduct();
  // The inputs are untouched: the body differentiated copies of nothing, views of them.
  EXPECT_EQ(Values(*c.ba), c.a);
}

TEST_F(ExecutableTest, GradientOfAnInputTheOutputsIgnoreIsZeroAndBadGradientsAreErrors) {
  FunctionBody body{FunctionBody::Kind::kTorchScript, "g", "def g(a, b):\n    return a * 2.0\n"};
  body.gradient = FunctionBody::Gradient{{1}, {{}, {}}, {{}}, false};
  auto exe = cache_.Compile(body);
  ASSERT_TRUE(exe.ok()) << exe.status();
  BufferPtr a = MakeF32({2}, {1, 2}), b = MakeF32({2}, {3, 4}), dy = MakeF32({2}, {1, 1});
  BufferPtr db = MakeF32({2}, {7, 7});
  const DeviceBuffer* ins[] = {a.get(), b.get(), dy.get()};
  DeviceBuffer* outs[] = {db.get()};
  ASSERT_TRUE((*exe)->Run(ins, outs).ok());
  EXPECT_EQ(Values(*db), (std::vector<float>{0, 0}));

  // A cotangent of the wrong shape, a missing one, an integer input, an input out of range.
  BufferPtr wrong = MakeF32({3}, {1, 1, 1});
  const DeviceBuffer* bad[] = {a.get(), b.get(), wrong.get()};
  absl::Status s = (*exe)->Run(bad, outs);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cotangent of output 0"), std::string::npos) << s;
  const DeviceBuffer* missing[] = {a.get(), b.get()};
  s = (*exe)->Run(missing, outs);
  EXPECT_NE(s.message().find("no cotangent for output 0"), std::string::npos) << s;
  auto integer = cache_.Compile(TanhGradient({2}, false));
  ASSERT_TRUE(integer.ok());
  BufferPtr n = *device_.Allocate(DType::kI32, {2});
  BufferPtr dn = *device_.Allocate(DType::kI32, {2});
  const DeviceBuffer* int_ins[] = {a.get(), b.get(), n.get(), a.get(), dy.get()};
  DeviceBuffer* int_outs[] = {dn.get()};
  s = (*integer)->Run(int_ins, int_outs);
  EXPECT_NE(s.message().find("input 2 is not floating point"), std::string::npos) << s;
  EXPECT_EQ(cache_.Compile(TanhGradient({3}, false)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_.Compile(TanhGradient({0, 0}, false)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ExecutableTest, SplitGradientKeepsItsResidualsOnTheDeviceUntilItsHandleGoes) {
  ConfigureComputeThreads(1);  // installs the allocator that charges kernels' allocations
  FunctionBody forward_body = TanhGradient({0, 1}, false), backward_body = forward_body;
  forward_body.gradient->residuals = FunctionBody::Residuals::kKeep;
  backward_body.gradient->residuals = FunctionBody::Residuals::kUse;
  EXPECT_NE(FunctionKey(forward_body), FunctionKey(backward_body));
  EXPECT_NE(FunctionKey(forward_body), FunctionKey(TanhGradient({0, 1}, false)));
  EXPECT_EQ(forward_body.DisplayName(), "vjp_forward(f)");
  auto forward = cache_.Compile(forward_body);
  auto backward = cache_.Compile(backward_body);
  ASSERT_TRUE(forward.ok()) << forward.status();
  ASSERT_TRUE(backward.ok()) << backward.status();
  TanhCase c = MakeTanhCase();
  BufferPtr handle = *device_.Allocate(DType::kI64, {});
  auto budget = std::make_shared<MemoryBudget>("device", 16 << 20);
  {
    MemoryBudget::ScopedCurrent scope(budget);
    const DeviceBuffer* ins[] = {c.ba.get(), c.bb.get(), c.n.get()};
    DeviceBuffer* outs[] = {c.y1.get(), c.y2.get(), handle.get()};
    ASSERT_TRUE((*forward)->Run(ins, outs).ok());
  }
  // tanh(a) is kept (for both products), and so are the outputs; the handle says how much.
  const int64_t kept = *reinterpret_cast<const int64_t*>(handle->data());
  EXPECT_GT(kept, 0);
  EXPECT_EQ(budget->used(), kept);
  EXPECT_GT(c.ba.use_count(), 1);  // the graph holds views of the inputs it saved

  const DeviceBuffer* bins[] = {handle.get(), c.dy1.get(), c.dy2.get()};
  DeviceBuffer* bouts[] = {c.da.get(), c.db.get()};
  for (int pass = 0; pass < 2; ++pass) {  // a kept graph serves more than one backward pass
    MemoryBudget::ScopedCurrent scope(budget);
    ASSERT_TRUE((*backward)->Run(bins, bouts).ok());
    c.ExpectProduct();
  }
  EXPECT_EQ(budget->used(), kept);

  // A handle with no residuals (a copy of one, as a transfer makes), and one of another function.
  BufferPtr copy = *device_.Allocate(DType::kI64, {});
  std::memcpy(copy->data(), handle->data(), 8);
  const DeviceBuffer* copied[] = {copy.get(), c.dy1.get(), c.dy2.get()};
  absl::Status s = (*backward)->Run(copied, bouts);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("carries no residuals on this device"), std::string::npos) << s;
  FunctionBody other = backward_body;
  other.gradient->wrt = {1};
  auto other_backward = cache_.Compile(other);
  ASSERT_TRUE(other_backward.ok());
  DeviceBuffer* one_out[] = {c.db.get()};
  s = (*other_backward)->Run(bins, one_out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("residuals of another function"), std::string::npos) << s;
  // An output that is one of the inputs (donated in place) would be written under the graph.
  {
    const DeviceBuffer* ins[] = {c.ba.get(), c.bb.get(), c.n.get()};
    DeviceBuffer* outs[] = {c.ba.get(), c.y2.get(), copy.get()};
    s = (*forward)->Run(ins, outs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("cannot take a donated input's buffer"), std::string::npos) << s;
  }
  FunctionBody with_outputs = forward_body;
  with_outputs.gradient->with_outputs = true;
  EXPECT_EQ(cache_.Compile(with_outputs).status().code(), absl::StatusCode::kInvalidArgument);

  // Freeing the handle frees what it kept, and lets go of the inputs.
  handle.reset();
  EXPECT_EQ(budget->used(), 0);
  EXPECT_EQ(c.ba.use_count(), 1);
}

// An output that a later op of the pass saved stays with the graph, and the handle counts it;
// one nothing saved goes once copied out, and the handle leaves it out.
TEST_F(ExecutableTest, AResidualHandleCountsWhatStaysOnTheDevice) {
  ConfigureComputeThreads(1);
  FunctionBody body{FunctionBody::Kind::kTorchScript, "g", "def g(a, b):\n    h = a * 2.0\n    return h, h * b\n"};
  body.gradient = FunctionBody::Gradient{{0, 1}, {{}, {}}, {{}, {}}, false};
  body.gradient->residuals = FunctionBody::Residuals::kKeep;
  auto forward = cache_.Compile(body);
  ASSERT_TRUE(forward.ok()) << forward.status();
  BufferPtr a = MakeF32({256}, std::vector<float>(256, 1.5f)), b = MakeF32({256}, std::vector<float>(256, 2));
  BufferPtr h = *device_.Allocate(DType::kF32, {256}), y = *device_.Allocate(DType::kF32, {256});
  BufferPtr handle = *device_.Allocate(DType::kI64, {});
  auto budget = std::make_shared<MemoryBudget>("device", 16 << 20);
  {
    MemoryBudget::ScopedCurrent scope(budget);
    const DeviceBuffer* ins[] = {a.get(), b.get()};
    DeviceBuffer* outs[] = {h.get(), y.get(), handle.get()};
    ASSERT_TRUE((*forward)->Run(ins, outs).ok());
  }
  const int64_t kept = *reinterpret_cast<const int64_t*>(handle->data());
  EXPECT_GE(kept, 256 * 4);  // h, saved by h * b (y, saved by nothing, is not kept)
  EXPECT_EQ(budget->used(), kept);
  EXPECT_NEAR(Values(*y)[7], 6.0f, 1e-6);
}

// A forward pass that keeps its residuals keeps its autograd graph too: its nodes and saved
// metadata are in the host's heap, not the device's allocator, and before they were charged only
// while the body ran. They are charged to the device until the handle goes, and counted by it.
TEST_F(ExecutableTest, AKeptGraphsOwnMemoryIsChargedUntilItsHandleGoes) {
  if (!BodyHeapCountsNew()) GTEST_SKIP() << "a body's operator new is not counted in this build (ThreadSanitizer)";
  ConfigureComputeThreads(1);
  FunctionBody body{FunctionBody::Kind::kTorchScript, "chain",
                    "def chain(a):\n    h = a\n    for _ in range(int(a.size(0)) * 2000):\n        h = h * 1.0001\n"
                    "    return h\n"};
  body.gradient = FunctionBody::Gradient{{0}, {{}}, {{}}, false};
  body.gradient->residuals = FunctionBody::Residuals::kKeep;
  auto forward = cache_.Compile(body);
  ASSERT_TRUE(forward.ok()) << forward.status();
  BufferPtr a = MakeF32({16}, std::vector<float>(16, 1.0f));  // 32000 nodes
  BufferPtr h = *device_.Allocate(DType::kF32, {16});
  BufferPtr handle = *device_.Allocate(DType::kI64, {});
  auto budget = std::make_shared<MemoryBudget>("device", 256 << 20);
  const DeviceBuffer* ins[] = {a.get()};
  DeviceBuffer* outs[] = {h.get(), handle.get()};
  {
    MemoryBudget::ScopedCurrent scope(budget);
    ASSERT_TRUE((*forward)->Run(ins, outs).ok());
  }
  const int64_t kept = *reinterpret_cast<const int64_t*>(handle->data());
  EXPECT_GE(kept, 32000 * 64) << "the graph's nodes, counted by the handle";
  EXPECT_EQ(budget->used(), kept);
  handle.reset();
  EXPECT_EQ(budget->used(), 0);

  // On a device too small for the graph, the forward pass fails and leaves nothing charged.
  handle = *device_.Allocate(DType::kI64, {});
  outs[1] = handle.get();
  auto small = std::make_shared<MemoryBudget>("small", kept / 4);
  MemoryBudget::ScopedCurrent scope(small);
  absl::Status s = (*forward)->Run(ins, outs);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("residuals' graph"), std::string::npos) << s;
  EXPECT_EQ(small->used(), 0);
}

TEST_F(ExecutableTest, KernelTemporariesAreChargedToTheDeviceRunningThem) {
  ConfigureComputeThreads(1);  // installs the allocator that charges them, as workers do
  // A 4 MiB temporary (x expanded to 1M elements), summed back to a scalar.
  auto exe = cache_.Compile({FunctionBody::Kind::kTorchScript, "wide",
                             "def wide(x):\n    return x.expand(1048576).contiguous().sum()\n"});
  ASSERT_TRUE(exe.ok()) << exe.status();
  BufferPtr in = MakeF32({1}, {2});
  BufferPtr out = *device_.Allocate(DType::kF32, {});
  const DeviceBuffer* ins[] = {in.get()};
  DeviceBuffer* outs[] = {out.get()};
  auto small = std::make_shared<MemoryBudget>("small", 1 << 20);
  {
    MemoryBudget::ScopedCurrent scope(small);
    absl::Status s = (*exe)->Run(ins, outs);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("'wide' ran out of device memory"), std::string::npos) << s;
  }
  EXPECT_EQ(small->used(), 0);
  auto large = std::make_shared<MemoryBudget>("large", 16 << 20);
  {
    MemoryBudget::ScopedCurrent scope(large);
    ASSERT_TRUE((*exe)->Run(ins, outs).ok());
  }
  EXPECT_EQ(Values(*out)[0], 2.0f * 1048576);
  EXPECT_EQ(large->used(), 0);
  EXPECT_GE(large->peak(), 4 << 20);
  large->ResetPeak();
  EXPECT_EQ(large->peak(), 0);
}

}  // namespace
}  // namespace pathways
