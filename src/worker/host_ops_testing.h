// Ops of one client ("c", session 1) for tests that drive a HostRuntime directly, a program over
// two hosts, and reading an array's shard back from a host.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "core/status_macros.h"
#include "proto/pathways.pb.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"

namespace pathways::testing {

inline constexpr char kClient[] = "c";
inline constexpr int64_t kTwoHostProgram = 3;

// Puts `values` (f32) as shard `shard` of `array_id` on local device `device`.
inline rpc::Op PutOp(int64_t seq, int64_t array_id, int device, const std::vector<float>& values, int shard = 0) {
  rpc::Op op;
  op.set_seq(seq);
  op.set_session(1);
  rpc::PutOp* put = op.mutable_put();
  put->mutable_dest()->set_array_id(array_id);
  put->mutable_dest()->set_shard(shard);
  put->set_local_device(device);
  *put->mutable_spec() = ToProto(TensorSpec{DType::kF32, {static_cast<int64_t>(values.size())}});
  put->set_data(values.data(), values.size() * sizeof(float));
  return op;
}

// A run of `program` (epoch `seq`) whose outputs take ids base .. base + outputs - 1.
inline rpc::Op RunOp(int64_t seq, int64_t program, int64_t base, int64_t outputs) {
  rpc::Op op;
  op.set_seq(seq);
  op.set_session(1);
  op.mutable_run()->set_program_id(program);
  op.mutable_run()->set_output_array_base(base);
  op.mutable_run()->set_num_output_arrays(outputs);
  op.mutable_run()->set_epoch(seq);
  return op;
}

// Slice 1: two devices on host A; slice 2: two devices on host B; both a mesh {x: 2}. The
// argument f32[8] is split over slice 1. Node 0 (on A) applies the function compiled as `first`
// and keeps it split; node 1
// (on B) adds one to node 0's output split the same way (each of B's shards takes one block from
// A); node 2 (on B) adds one to it whole (each of B's shards takes both of A's blocks).
inline rpc::ProgramProto TwoHostProgram(const std::string& first, const std::string& add_one) {
  rpc::ProgramProto p;
  p.set_program_id(kTwoHostProgram);
  p.set_name("two_hosts");
  for (int s = 1; s <= 2; ++s) {
    rpc::SliceProto* slice = p.add_slices();
    slice->set_slice_id(s);
    slice->add_mesh_dims(2);
    slice->add_axis_names("x");
    for (int d = 0; d < 2; ++d) {
      rpc::SliceDevice* device = slice->add_devices();
      device->set_device_id((s - 1) * 2 + d);
      device->set_host_address(s == 1 ? "A" : "B");
      device->set_local_index(d);
    }
  }
  const rpc::TensorSpecProto spec = ToProto(TensorSpec{DType::kF32, {8}});
  rpc::PartitionSpecProto split, whole;
  split.add_dims("x");
  whole.add_dims("");
  rpc::ProgramArg* arg = p.add_args();
  *arg->mutable_spec() = spec;
  arg->set_slice_id(1);
  *arg->mutable_sharding() = split;
  auto add_node = [&](const std::string& key, int slice, bool input_is_arg, const rpc::PartitionSpecProto& in) {
    rpc::ProgramNode* node = p.add_nodes();
    node->set_function_key(key);
    node->set_function_name(key);
    node->set_slice_id(slice);
    rpc::ValueRef* v = node->add_inputs();
    v->set_is_arg(input_is_arg);
    v->set_index(0);
    *node->add_input_specs() = spec;
    *node->add_in_shardings() = in;
    *node->add_output_specs() = spec;
    *node->add_out_shardings() = in;
  };
  add_node(first, 1, true, split);
  add_node(add_one, 2, false, split);
  add_node(add_one, 2, false, whole);
  for (int n = 1; n <= 2; ++n) p.add_results()->set_index(n);
  return p;
}

// Shard `shard` of `array_id` (f32) once op `seq` of the client is applied on `host`.
inline absl::StatusOr<std::vector<float>> FetchShard(HostRuntime& host, int64_t array_id, int64_t seq, int shard = 0) {
  rpc::FetchRequest request;
  request.set_client_id(kClient);
  request.set_array_id(array_id);
  request.add_shards(shard);
  request.set_after_seq(seq);
  request.set_session(1);
  // The fetch writes into the response until it completes, even after a timed-out wait.
  auto kept = std::make_shared<rpc::FetchResponse>();
  Future<Unit> done = host.Fetch(request, kept.get());
  done.OnReady([kept](const absl::StatusOr<Unit>&) {});
  PW_RETURN_IF_ERROR(done.AwaitFor(absl::Seconds(30)).status());
  const rpc::FetchResponse& response = *kept;
  if (response.shards_size() != 1) return absl::InternalError("expected one shard");
  const std::string& data = response.shards(0).data();
  std::vector<float> values(data.size() / sizeof(float));
  std::memcpy(values.data(), data.data(), values.size() * sizeof(float));
  return values;
}

}  // namespace pathways::testing
