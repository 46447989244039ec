// Planning a registered program on one host: what the host sends, receives and computes for
// each node, and the program's dataflow graph of block exchanges. Pure: every host derives the
// same plans and the same graph from the lowered program, so they agree without talking.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "array/resharding.h"
#include "collective/collective.h"
#include "core/types.h"
#include "dataflow/graph.h"
#include "worker/lowered_program.h"

namespace pathways {

// A block of an input this host owes another host: a region of one of its source shards.
struct PlannedSend {
  int input;
  int64_t src_shard;
  Region region;  // in the source shard
  std::string dest;
  int32_t dst_shard;
};

// One of this host's shards of a node: the pieces each input is assembled from.
struct ShardPlan {
  int64_t shard;
  std::vector<std::vector<Piece>> inputs;  // per input
};

// What this host does for one program node:
// - which blocks of its inputs it owes other hosts, and which pieces each of its own shards
//   reads from where;
// - the node's block exchange in the program's dataflow graph: a sending node (a shard per
//   sending host) joined by a sparse edge to a receiving node (a shard per receiving host),
//   which also has a one-to-one edge from an arming node on the receiving hosts. A receiving
//   host closes its arming shard once it has set up the node's shards, so a receiver's epoch
//   ends only when every sender is done and the host waits for exactly the blocks it will get.
//   A node whose inputs never cross hosts has no exchange and costs no dataflow traffic.
struct NodePlan {
  std::vector<PlannedSend> sends;
  std::vector<ShardPlan> shards;  // this host's shards of the node
  int send_node = -1;  // dataflow graph node ids; -1 when the node moves nothing between hosts
  int arm_node = -1;
  int recv_node = -1;
  int edge = -1;  // send -> recv
  std::map<std::string, int> sender_index, receiver_index;  // hosts -> their shard of send/recv
  std::shared_ptr<const collective::GangLayout> gang;  // who the node's shards meet in collectives
  std::vector<TensorSpec> out_specs;  // of each output's local shard
};

struct ProgramPlan {
  std::vector<NodePlan> nodes;  // per program node
  std::shared_ptr<dataflow::GraphDef> graph;  // named `graph_name`
};

// The plan of `program` on `host`.
absl::StatusOr<ProgramPlan> PlanProgram(const LoweredProgram& program, const std::string& host,
                                        const std::string& graph_name);

}  // namespace pathways
