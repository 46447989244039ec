// A registered program as one host sees it: validated, with its slices' device maps and its
// shardings built once, so each run only walks the nodes.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "array/resharding.h"
#include "array/sharding.h"
#include "core/types.h"
#include "proto/pathways.pb.h"

namespace pathways {

struct LoweredSlice {
  Mesh mesh;
  std::vector<DeviceLocation> devices;   // one per shard
  std::vector<int32_t> local_devices;    // per shard: device index on this host, or -1
  std::vector<int64_t> local_shards;     // shards on this host
  std::vector<std::string> hosts;        // distinct, in device order
};

struct LoweredValue {
  bool is_arg;
  int index;
  int output;
};

struct LoweredNode {
  std::string function_key;
  std::string function_name;
  const LoweredSlice* slice;  // owned by the program
  std::vector<LoweredValue> inputs;
  std::vector<TensorSpec> input_specs;  // global
  std::vector<Sharding> in_shardings;   // on the node's slice
  std::vector<TensorSpec> output_specs; // global
  std::vector<Sharding> out_shardings;  // on the node's slice
  int64_t output_offset;                // outputs of the nodes before this one
  std::vector<int> output_donors;       // per output: the input whose buffer it takes, or -1; empty if none does
};

struct LoweredArg {
  TensorSpec spec;
  const LoweredSlice* slice;
  Sharding sharding;
};

// Immutable once built; shared by concurrent runs.
class LoweredProgram {
 public:
  // Validates everything a run relies on: slice references, shapes and shardings, value
  // references (only to arguments and earlier nodes), and that devices placed on `host` exist.
  static absl::StatusOr<std::shared_ptr<const LoweredProgram>> Create(const rpc::ProgramProto& proto,
                                                                       const std::string& host,
                                                                       int num_local_devices);
  int64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  const std::vector<LoweredArg>& args() const { return args_; }
  const std::vector<LoweredNode>& nodes() const { return nodes_; }
  // Outputs (as offsets from a run's output base) that hosts drop once the op containing node
  // `node` is set up: intermediates whose last consumer is `node` (see ProgramProto). Results
  // never appear; the client frees them.
  const std::vector<int64_t>& dropped_after(int node) const { return dropped_after_[node]; }
  // Arguments that node `node` takes at donated positions: hosts drop them from the store once
  // the op containing the node is set up, so that the node can take their buffers.
  const std::vector<int>& args_donated_to(int node) const { return args_donated_to_[node]; }
  // Every host of every slice, in the order the program lists them: the same on every host.
  const std::vector<std::string>& hosts() const { return hosts_; }
  // The placement of a value: its sharding and the devices holding its shards.
  Placement PlacementOf(const LoweredValue& v) const;

 private:
  int64_t id_ = 0;
  std::string name_;
  std::map<int64_t, LoweredSlice> slices_;
  std::vector<LoweredArg> args_;
  std::vector<LoweredNode> nodes_;
  std::vector<std::vector<int64_t>> dropped_after_;
  std::vector<std::vector<int>> args_donated_to_;
  std::vector<std::string> hosts_;
};

}  // namespace pathways
