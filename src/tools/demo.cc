#include "tools/demo.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/program.h"
#include "cluster/local_cluster.h"
#include "compute/executable.h"
#include "compute/function_cache.h"
#include "core/status_macros.h"
#include "device/cpu_device.h"

namespace pathways {
namespace {

HostArray Pattern(Shape shape, float scale) {
  HostArray a = *HostArray::Create(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < a.num_elements(); ++i) {
    a.mutable_data<float>()[i] = scale * static_cast<float>((i * 7919) % 31 - 15);
  }
  return a;
}

// Runs a body on one local device through the compute layer: the reference result.
absl::StatusOr<HostArray> RunLocally(const FunctionBody& body, const std::vector<const HostArray*>& inputs,
                                     const TensorSpec& output) {
  FunctionCache cache;
  CpuDevice device(0, int64_t{1} << 30, "reference");
  PW_ASSIGN_OR_RETURN(auto exe, cache.Compile(body));
  std::vector<BufferPtr> in;
  std::vector<const DeviceBuffer*> in_ptrs;
  for (const HostArray* h : inputs) {
    PW_ASSIGN_OR_RETURN(BufferPtr b, device.Allocate(h->dtype(), h->shape()));
    std::memcpy(b->data(), h->bytes().data(), h->bytes().size());
    in_ptrs.push_back(b.get());
    in.push_back(std::move(b));
  }
  PW_ASSIGN_OR_RETURN(BufferPtr out, device.Allocate(output.dtype, output.shape));
  DeviceBuffer* out_ptr = out.get();
  PW_RETURN_IF_ERROR(exe->Run(in_ptrs, {&out_ptr, 1}));
  return HostArray::FromBytes(output.dtype, output.shape, std::string(out->data(), out->byte_size()));
}

void PrintPlacement(const char* what, const ShardedArray& a) {
  std::printf("  %s: %s sharded %s over mesh %s\n", what, a.spec().ToString().c_str(),
              PartitionSpecToString(a.sharding().spec()).c_str(), a.slice().mesh().ToString().c_str());
  for (int64_t s = 0; s < a.slice().num_devices(); ++s) {
    const PhysicalDeviceInfo& d = a.slice().devices()[s];
    Region r = a.sharding().ShardRegion(s);
    std::printf("    shard %lld -> island %d host %d (%s) cpu:%d  rows %lld..%lld cols %lld..%lld\n",
                static_cast<long long>(s), d.island, static_cast<int>(d.host_id.value()), d.host_address.c_str(), d.local_index,
                static_cast<long long>(r.start[0]), static_cast<long long>(r.start[0] + r.size[0]),
                static_cast<long long>(r.start[1]), static_cast<long long>(r.start[1] + r.size[1]));
  }
}

}  // namespace

absl::Status RunDemo(const Flags& flags) {
  PW_RETURN_IF_ERROR(flags.CheckWritable("trace"));  // before the work, not after it
  LocalClusterOptions options;
  PW_ASSIGN_OR_RETURN(int64_t islands, flags.GetInt("islands", 2));
  PW_ASSIGN_OR_RETURN(int64_t hosts, flags.GetInt("hosts", 2));
  PW_ASSIGN_OR_RETURN(int64_t devices, flags.GetInt("devices", 4));
  if (islands < 2 || hosts < 1 || devices < 1 || hosts * devices < 8 || islands * hosts * devices > 256) {
    return absl::InvalidArgumentError("the demo needs at least 2 islands of at least 8 devices each, and at most 256 devices");
  }
  options.num_islands = static_cast<int>(islands);
  options.hosts_per_island = static_cast<int>(hosts);
  options.devices_per_host = static_cast<int>(devices);
  std::printf("Starting an embedded cluster: %d islands x %d hosts x %d CPU devices\n",
              options.num_islands, options.hosts_per_island, options.devices_per_host);
  PW_ASSIGN_OR_RETURN(auto cluster, LocalCluster::Start(options));
  PW_ASSIGN_OR_RETURN(auto client, cluster->Connect());
  PW_ASSIGN_OR_RETURN(std::string description, client->DescribeCluster());
  std::printf("%s\n", description.c_str());

  // Stage 1 on island 0: a 2x4 mesh over 8 devices of two hosts. Stage 2 on island 1.
  PW_ASSIGN_OR_RETURN(VirtualSlice stage1, client->CreateSlice({.mesh_shape = {2, 4}, .island = 0}));
  PW_ASSIGN_OR_RETURN(VirtualSlice stage2, client->CreateSlice({.mesh_shape = {8}, .axis_names = {"r"}, .island = 1}));
  const int64_t batch = 256, features = 128, hidden = 64;
  const TensorSpec x_spec{DType::kF32, {batch, features}}, w_spec{DType::kF32, {features, hidden}},
      h_spec{DType::kF32, {batch, hidden}};

  PW_ASSIGN_OR_RETURN(CompiledFunction matmul,
                      client->Compile(FunctionSpec::Builtin("matmul", {x_spec, w_spec}, {h_spec},
                                                            {{"x", ""}, {"", "y"}}, {{"x", "y"}})));
  const char* kActivation =
      "def activation(h):\n"
      "    return torch.tanh(h * 0.01) * 2.0 + 1.0\n";
  PW_ASSIGN_OR_RETURN(CompiledFunction activation,
                      client->Compile(FunctionSpec::Script("activation", kActivation, {h_spec}, {h_spec},
                                                           {{"r", ""}}, {{"r", ""}})));

  HostArray x = Pattern(x_spec.shape, 0.1f), w = Pattern(w_spec.shape, 0.05f);
  PW_ASSIGN_OR_RETURN(ShardedArray fx, client->Put(x, stage1, {"x", ""}));
  PW_ASSIGN_OR_RETURN(ShardedArray fw, client->Put(w, stage1, {"", "y"}));

  // Both calls traced into one program, submitted with one client call. The activation consumes
  // h before it is computed; h's blocks move from island 0's hosts to island 1's.
  ProgramBuilder builder("two_stage");
  TracedValue tx = builder.Arg(x_spec), tw = builder.Arg(w_spec);
  PW_ASSIGN_OR_RETURN(auto th, builder.Call(matmul, stage1, {tx, tw}));
  PW_ASSIGN_OR_RETURN(auto ty, builder.Call(activation, stage2, {th[0]}));
  PW_ASSIGN_OR_RETURN(Program program, builder.Build({ty[0], th[0]}));
  if (flags.Has("print-ir")) {
    std::printf("High-level IR (virtual slices and shardings only):\n%s\n", program.ToString().c_str());
    PW_ASSIGN_OR_RETURN(std::string lowered, client->DescribeLowering(program, {fx, fw}));
    std::printf("Lowered onto physical devices:\n%s\n", lowered.c_str());
  }
  PW_ASSIGN_OR_RETURN(auto outputs, client->Run(program, {fx, fw}));
  std::vector<ShardedArray> y = {outputs[0]}, h = {outputs[1]};
  std::printf("What ran where:\n");
  std::printf(" matmul (built-in kernel) on island 0:\n");
  PrintPlacement("output h", h[0]);
  std::printf(" activation (TorchScript) on island 1, input resharded from (x,y) to (r,-):\n");
  PrintPlacement("output y", y[0]);

  PW_ASSIGN_OR_RETURN(HostArray result, client->Fetch(y[0]).Await());

  PW_ASSIGN_OR_RETURN(HostArray ref_h, RunLocally({FunctionBody::Kind::kBuiltin, "matmul", ""}, {&x, &w}, h_spec));
  PW_ASSIGN_OR_RETURN(HostArray ref_y, RunLocally({FunctionBody::Kind::kTorchScript, "activation", kActivation},
                                                  {&ref_h}, h_spec));
  double max_err = 0;
  for (int64_t i = 0; i < result.num_elements(); ++i) {
    max_err = std::max<double>(max_err, std::fabs(result.data<float>()[i] - ref_y.data<float>()[i]));
  }
  std::printf("\nDevice activity:\n");
  for (int i = 0; i < cluster->num_workers(); ++i) {
    HostRuntime& rt = cluster->worker(i).runtime();
    for (int d = 0; d < rt.num_devices(); ++d) {
      DeviceStats s = rt.device(d).stats();
      std::printf("  %-24s ran %lld computations, busy %lld us, %lld bytes held\n", rt.device(d).name().c_str(),
                  static_cast<long long>(s.executed), static_cast<long long>(s.busy_micros),
                  static_cast<long long>(s.memory_used));
    }
  }
  if (flags.Has("trace")) {
    PW_RETURN_IF_ERROR(client->WriteTrace(flags.Get("trace")));
    std::printf("\nTrace written to %s (open it in Perfetto; tools/plot_trace.py draws a PNG)\n",
                flags.Get("trace").c_str());
  }
  std::printf("\nResult y%s: max |pathways - libtorch on one device| = %.3g\n",
              ShapeToString(result.shape()).c_str(), max_err);
  if (max_err > 1e-4) return absl::InternalError("the sharded result does not match the local reference");
  std::printf("CHECK PASSED\n");
  return absl::OkStatus();
}

}  // namespace pathways
