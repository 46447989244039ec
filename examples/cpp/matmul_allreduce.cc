// Connects to a running cluster, multiplies a row-split matrix by a replicated one on a slice of
// N devices, sums the products' rows over the devices with an all_reduce inside TorchScript, and
// checks the result against the same arithmetic done here. Prints "ok" and exits 0 when they agree.
//
//   matmul_allreduce CONTROLLER_ADDRESS [DEVICES]
//
// The cluster's token and TLS authority come from PATHWAYS_TOKEN and PATHWAYS_TLS_CA when set
// (Client::Connect reads them).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <absl/synchronization/mutex.h>
#include <pathways/client/client.h>
#include <pathways/client/version.h>

using namespace pathways;

namespace {

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Abseil's lock-order checking (on in Debian's build) would cost every future of the client a
  // global update: a program that drives a cluster turns it off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONTROLLER_ADDRESS [DEVICES]\n", argv[0]);
    return 2;
  }
  const int64_t devices = argc > 2 ? std::atoi(argv[2]) : 2;
  if (devices < 1) {
    std::fprintf(stderr, "DEVICES must be a positive number, not '%s'\n", argv[2]);
    return 2;
  }
  std::printf("pathways %s\n", LibraryVersion());
  auto client = Client::Connect(argv[1]);
  if (!client.ok()) return Fail("connect", client.status());
  auto slice = (*client)->CreateSlice({.mesh_shape = {devices}});
  if (!slice.ok()) return Fail("slice", slice.status());

  const int64_t rows = 4 * devices, inner = 8, cols = 6;
  TensorSpec a{DType::kF32, {rows, inner}}, b{DType::kF32, {inner, cols}}, c{DType::kF32, {rows, cols}};
  TensorSpec summed{DType::kF32, {rows / devices, cols}};
  auto matmul = (*client)->Compile(FunctionSpec::Builtin("matmul", {a, b}, {c}, {{"x", ""}, {}}, {{"x", ""}}));
  if (!matmul.ok()) return Fail("compile matmul", matmul.status());
  // Each device adds its block of rows to every other device's: the result is replicated.
  auto sum = (*client)->Compile(FunctionSpec::Script(
      "sum_blocks", "def sum_blocks(x):\n    return pathways.all_reduce(x, 'x', 'sum')\n", {c}, {summed},
      {{"x", ""}}, {{}}));
  if (!sum.ok()) return Fail("compile sum_blocks", sum.status());

  std::vector<float> va(rows * inner), vb(inner * cols);
  for (size_t i = 0; i < va.size(); ++i) va[i] = 0.01f * static_cast<float>(i % 17);
  for (size_t i = 0; i < vb.size(); ++i) vb[i] = 0.1f * static_cast<float>(i % 5) - 0.2f;
  auto ha = HostArray::FromVector(DType::kF32, a.shape, va);
  auto hb = HostArray::FromVector(DType::kF32, b.shape, vb);
  if (!ha.ok() || !hb.ok()) return Fail("host arrays", ha.ok() ? hb.status() : ha.status());
  auto fa = (*client)->Put(*ha, *slice, {"x", ""});
  if (!fa.ok()) return Fail("put a", fa.status());
  auto fb = (*client)->Put(*hb, *slice);
  if (!fb.ok()) return Fail("put b", fb.status());
  auto product = (*client)->Call(*matmul, *slice, {*fa, *fb});  // returns at once: a future
  if (!product.ok()) return Fail("call matmul", product.status());
  auto total = (*client)->Call(*sum, *slice, {(*product)[0]});
  if (!total.ok()) return Fail("call sum_blocks", total.status());
  auto result = (*client)->Fetch((*total)[0]).Await();
  if (!result.ok()) return Fail("fetch", result.status());

  const int64_t block = rows / devices;
  const float* got = result->data<float>();
  for (int64_t r = 0; r < block; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      double want = 0;
      for (int64_t d = 0; d < devices; ++d) {
        for (int64_t k = 0; k < inner; ++k) want += va[(d * block + r) * inner + k] * vb[k * cols + j];
      }
      if (std::fabs(got[r * cols + j] - want) > 1e-4 * (1 + std::fabs(want))) {
        std::fprintf(stderr, "element (%lld, %lld): got %g, want %g\n", static_cast<long long>(r),
                     static_cast<long long>(j), got[r * cols + j], want);
        return 1;
      }
    }
  }
  std::printf("ok: %lld x %lld on %lld devices, first element %g\n", static_cast<long long>(block),
              static_cast<long long>(cols), static_cast<long long>(devices), got[0]);
  return 0;
}
