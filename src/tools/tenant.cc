#include "tools/tenant.h"

#include <cstdio>
#include <deque>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "core/status_macros.h"
#include "transport/auth.h"

namespace pathways {

absl::Status RunTenant(const Flags& flags) {
  PW_RETURN_IF_ERROR(flags.CheckWritable("trace"));  // before the work, not after it
  if (!flags.Has("controller")) return absl::InvalidArgumentError("tenant needs --controller HOST:PORT");
  PW_ASSIGN_OR_RETURN(std::string token, TokenFromFlagOrEnv(flags.Get("token")));
  SetCallToken(std::move(token));
  PW_ASSIGN_OR_RETURN(std::string address, flags.GetAddress("controller", "", false));
  PW_ASSIGN_OR_RETURN(int64_t devices, flags.GetInt("devices", 8));
  PW_ASSIGN_OR_RETURN(int64_t runs, flags.GetInt("runs", 100));
  PW_ASSIGN_OR_RETURN(int64_t value, flags.GetInt("value", 1));
  PW_ASSIGN_OR_RETURN(int64_t weight, flags.GetInt("weight", 1));
  if (devices < 1 || devices > 4096 || runs < 1 || runs > 10'000'000 || weight < 1 || weight > 1'000'000 ||
      value < -1000 || value > 1000) {
    return absl::InvalidArgumentError(
        "need 1 <= --devices <= 4096, 1 <= --runs <= 1e7, 1 <= --weight <= 1e6, -1000 <= --value <= 1000");
  }
  PW_ASSIGN_OR_RETURN(auto client,
                      Client::Connect(address, {.weight = static_cast<double>(weight)}));
  PW_ASSIGN_OR_RETURN(VirtualSlice slice,
                      client->CreateSlice({.mesh_shape = {devices}, .span_islands = flags.Has("span-islands")}));
  constexpr int64_t kCols = 64;
  const TensorSpec spec{DType::kF32, {devices, kCols}};
  PW_ASSIGN_OR_RETURN(CompiledFunction step,
                      client->Compile(FunctionSpec::Script(
                          "tenant_step", "def tenant_step(x):\n    return pathways.all_reduce(x * 2.0, 'x')\n",
                          {spec}, {spec}, {{"x", ""}}, {{"x", ""}})));
  // Row r holds value * (r + 1); every shard's all_reduce sums 2 * value * (1 + ... + devices).
  HostArray data = *HostArray::Create(DType::kF32, {devices, kCols});
  for (int64_t r = 0; r < devices; ++r) {
    for (int64_t c = 0; c < kCols; ++c) data.mutable_data<float>()[r * kCols + c] = static_cast<float>(value * (r + 1));
  }
  const float expected = static_cast<float>(value * devices * (devices + 1));
  PW_ASSIGN_OR_RETURN(ShardedArray x, client->Put(data, slice, {"x", ""}));
  std::printf("tenant %s: %lld runs over %s\n", client->id().c_str(), static_cast<long long>(runs),
              slice.ToString().c_str());
  std::fflush(stdout);
  if (flags.Has("wait-for-go")) {
    // Tenants that must overlap (a test of how their gangs are ordered) start together.
    char line[16];
    if (std::fgets(line, sizeof line, stdin) == nullptr) return absl::CancelledError("stdin closed before the go");
  }
  std::deque<ShardedArray> in_flight;
  int64_t checked = 0;
  auto check_oldest = [&]() -> absl::Status {
    PW_ASSIGN_OR_RETURN(HostArray got, client->Fetch(in_flight.front()).Await());
    in_flight.pop_front();
    for (int64_t i = 0; i < got.num_elements(); ++i) {
      if (got.data<float>()[i] != expected) {
        return absl::InternalError(absl::StrCat("run ", checked, " element ", i, " is ", got.data<float>()[i],
                                                ", expected ", expected));
      }
    }
    ++checked;
    return absl::OkStatus();
  };
  for (int64_t i = 0; i < runs; ++i) {
    if (in_flight.size() == 8) PW_RETURN_IF_ERROR(check_oldest());
    PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> out, client->Call(step, slice, {x}));
    in_flight.push_back(out[0]);
  }
  while (!in_flight.empty()) PW_RETURN_IF_ERROR(check_oldest());
  if (flags.Has("trace")) PW_RETURN_IF_ERROR(client->WriteTrace(flags.Get("trace")));
  std::printf("tenant %s: %lld runs, every result %g: CHECK PASSED\n", client->id().c_str(),
              static_cast<long long>(checked), expected);
  return absl::OkStatus();
}

}  // namespace pathways
