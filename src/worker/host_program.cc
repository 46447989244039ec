// Registering a program on a host: its plan (worker/program_plan.h) and the operators of its
// block exchanges in the program's dataflow engine.
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "dataflow/graph.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"
#include "worker/program_plan.h"

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
  PW_ASSIGN_OR_RETURN(ProgramPlan plan, PlanProgram(*program->lowered, name(),
                                                    absl::StrCat(client, "/", proto.program_id())));
  program->nodes = std::move(plan.nodes);
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
      name(), std::move(plan.graph),
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
  program->lost = options_.dataflow_service->AddEngine(program->engine.get());
  engines_.Add(program->engine);
  slot = std::move(program);
  return absl::OkStatus();
}

}  // namespace pathways
