// Registering a program on a host: the plan of what this host sends, receives and computes for
// each node, and the node's block exchange in the program's dataflow graph (see
// HostRuntime::NodePlan).
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "array/sharding.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "dataflow/graph.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"
#include "worker/input_assembly.h"

namespace pathways {

absl::Status HostRuntime::RegisterProgram(const std::string& client, const rpc::ProgramProto& proto) {
  if (options_.dataflow_service == nullptr) return absl::FailedPreconditionError("host has no dataflow service");
  auto program = std::make_shared<HostProgram>();
  PW_ASSIGN_OR_RETURN(program->lowered, LoweredProgram::Create(proto, name(), num_devices()));
  program->client = client;
  if (dcn_ != nullptr) {
    for (const rpc::SliceProto& slice : proto.slices()) {
      for (const rpc::SliceDevice& d : slice.devices()) dcn_->NoteHost(d.host_address(), d.island());
    }
  }
  const LoweredProgram& lowered = *program->lowered;
  // Every host derives the same graph: the same plans over the same hosts in the same order.
  auto graph = std::make_shared<dataflow::GraphDef>(absl::StrCat(client, "/", proto.program_id()));
  std::map<const LoweredSlice*, std::shared_ptr<const collective::GangLayout>> gangs;  // one per slice
  for (int n = 0; n < static_cast<int>(lowered.nodes().size()); ++n) {
    const LoweredNode& node = lowered.nodes()[n];
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
      Placement src = lowered.PlacementOf(node.inputs[i]);
      Placement dst{&node.in_shardings[i], &node.slice->devices};
      size_t local = 0;  // index into plan.shards, which follows local_shards' order
      for (int64_t d = 0; d < static_cast<int64_t>(node.slice->devices.size()); ++d) {
        const std::string& dest = node.slice->devices[d].host;
        std::vector<Piece> pieces = PlanShard(src, dst, d);
        for (const Piece& p : pieces) {
          const std::string& from = (*src.devices)[p.src_shard].host;
          if (from == dest) continue;
          senders.insert(from);
          receivers.insert(dest);
          if (from == name()) {
            plan.sends.push_back({static_cast<int>(i), p.src_shard, p.src_region, dest, static_cast<int32_t>(d)});
          }
        }
        if (dest == name()) plan.shards[local++].inputs[i] = std::move(pieces);
      }
    }
    if (!senders.empty()) {
      std::vector<std::string> send_hosts(senders.begin(), senders.end());
      std::vector<std::string> recv_hosts(receivers.begin(), receivers.end());
      for (int i = 0; i < static_cast<int>(send_hosts.size()); ++i) plan.sender_index[send_hosts[i]] = i;
      for (int i = 0; i < static_cast<int>(recv_hosts.size()); ++i) plan.receiver_index[recv_hosts[i]] = i;
      plan.send_node = *graph->AddNode(absl::StrCat("send", n), std::move(send_hosts));
      plan.arm_node = *graph->AddNode(absl::StrCat("arm", n), recv_hosts);
      plan.recv_node = *graph->AddNode(absl::StrCat("recv", n), std::move(recv_hosts));
      plan.edge = *graph->AddEdge(plan.send_node, plan.recv_node, dataflow::EdgeKind::kSparse);
      (void)*graph->AddEdge(plan.arm_node, plan.recv_node, dataflow::EdgeKind::kOneToOne);
    }
    program->nodes.push_back(std::move(plan));
  }
  // Graph node -> its operator: a sender (with its edge), an arming source, or a receiver (with
  // the program node whose blocks it takes).
  enum class Role { kSend, kArm, kReceive };
  std::map<int, std::pair<Role, int>> roles;
  for (int n = 0; n < static_cast<int>(program->nodes.size()); ++n) {
    const NodePlan& e = program->nodes[n];
    if (e.send_node < 0) continue;
    roles[e.send_node] = {Role::kSend, e.edge};
    roles[e.arm_node] = {Role::kArm, 0};
    roles[e.recv_node] = {Role::kReceive, n};
  }
  program->engine = std::make_shared<dataflow::Engine>(
      name(), std::move(graph),
      [this, client, roles](int node, int) -> std::unique_ptr<dataflow::Operator> {
        auto [role, value] = roles.at(node);
        switch (role) {
          case Role::kSend: return MakeBlockSender(value);
          case Role::kArm: return MakeArmingSource();
          case Role::kReceive: break;
        }
        return MakeBlockReceiver(client, value);
      },
      dcn_transport_ != nullptr ? static_cast<dataflow::Transport&>(*dcn_transport_) : dataflow_transport_, io_pool_);
  absl::MutexLock lock(&programs_mu_);
  auto& slot = programs_[{client, LoweredProgramId(proto.program_id())}];
  if (slot != nullptr) return absl::AlreadyExistsError(absl::StrCat("program ", proto.program_id(), " is already registered"));
  options_.dataflow_service->AddEngine(program->engine.get());
  engines_.Add(program->engine);
  slot = std::move(program);
  return absl::OkStatus();
}

}  // namespace pathways
