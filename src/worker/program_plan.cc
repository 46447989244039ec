#include "worker/program_plan.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace pathways {

absl::StatusOr<ProgramPlan> PlanProgram(const LoweredProgram& program, const std::string& host,
                                        const std::string& graph_name) {
  ProgramPlan result;
  result.graph = std::make_shared<dataflow::GraphDef>(graph_name);
  dataflow::GraphDef& graph = *result.graph;
  std::map<const LoweredSlice*, std::shared_ptr<const collective::GangLayout>> gangs;  // one per slice
  for (int n = 0; n < static_cast<int>(program.nodes().size()); ++n) {
    const LoweredNode& node = program.nodes()[n];
    NodePlan plan;
    std::shared_ptr<const collective::GangLayout>& gang = gangs[node.slice];
    if (gang == nullptr) {
      auto layout = std::make_shared<collective::GangLayout>();
      layout->mesh_dims = node.slice->mesh.dims;
      layout->axis_names = node.slice->mesh.axis_names;
      for (const DeviceLocation& d : node.slice->devices) layout->members.push_back({d.host, d.device_id});
      gang = std::move(layout);
    }
    plan.gang = gang;
    for (size_t j = 0; j < node.output_specs.size(); ++j) {
      plan.out_specs.push_back({node.output_specs[j].dtype, node.out_shardings[j].local_shape()});
    }
    for (int64_t shard : node.slice->local_shards) {
      plan.shards.push_back({shard, std::vector<std::vector<Piece>>(node.inputs.size())});
    }
    std::set<std::string> senders, receivers;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      Placement src = program.PlacementOf(node.inputs[i]);
      Placement dst{&node.in_shardings[i], &node.slice->devices};
      if (src.devices == dst.devices && *src.sharding == *dst.sharding) {
        // The input is laid out as the node takes it (a chain on one slice): every shard reads
        // its own device's block, so nothing crosses hosts and only this host's shards need a
        // plan. Without this, every host planned every shard of every node, and registering a
        // 128-node chain over 512 hosts took half a minute.
        for (size_t k = 0; k < node.slice->local_shards.size(); ++k) {
          plan.shards[k].inputs[i] = PlanShard(src, dst, node.slice->local_shards[k]);
        }
        continue;
      }
      size_t local = 0;  // index into plan.shards, which follows local_shards' order
      for (int64_t d = 0; d < static_cast<int64_t>(node.slice->devices.size()); ++d) {
        const std::string& dest = node.slice->devices[d].host;
        std::vector<Piece> pieces = PlanShard(src, dst, d);
        for (const Piece& p : pieces) {
          const std::string& from = (*src.devices)[p.src_shard].host;
          if (from == dest) continue;
          senders.insert(from);
          receivers.insert(dest);
          if (from == host) {
            plan.sends.push_back({static_cast<int>(i), p.src_shard, p.src_region, dest, static_cast<int32_t>(d)});
          }
        }
        if (dest == host) plan.shards[local++].inputs[i] = std::move(pieces);
      }
    }
    if (!senders.empty()) {
      std::vector<std::string> send_hosts(senders.begin(), senders.end());
      std::vector<std::string> recv_hosts(receivers.begin(), receivers.end());
      for (int i = 0; i < static_cast<int>(send_hosts.size()); ++i) plan.sender_index[send_hosts[i]] = i;
      for (int i = 0; i < static_cast<int>(recv_hosts.size()); ++i) plan.receiver_index[recv_hosts[i]] = i;
      PW_ASSIGN_OR_RETURN(plan.send_node, graph.AddNode(absl::StrCat("send", n), std::move(send_hosts)));
      PW_ASSIGN_OR_RETURN(plan.arm_node, graph.AddNode(absl::StrCat("arm", n), recv_hosts));
      PW_ASSIGN_OR_RETURN(plan.recv_node, graph.AddNode(absl::StrCat("recv", n), std::move(recv_hosts)));
      PW_ASSIGN_OR_RETURN(plan.edge, graph.AddEdge(plan.send_node, plan.recv_node, dataflow::EdgeKind::kSparse));
      PW_RETURN_IF_ERROR(graph.AddEdge(plan.arm_node, plan.recv_node, dataflow::EdgeKind::kOneToOne).status());
    }
    result.nodes.push_back(std::move(plan));
  }
  return result;
}

}  // namespace pathways
