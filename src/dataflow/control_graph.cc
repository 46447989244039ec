#include "dataflow/control_graph.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"

namespace pathways::dataflow {

std::string ControlGraphName(const rpc::ControlGraph& def) {
  return absl::StrCat(kControlGraphPrefix, def.island(), "/", def.controller_incarnation(), "/", def.generation());
}

absl::StatusOr<std::shared_ptr<const GraphDef>> MakeControlGraph(const rpc::ControlGraph& def) {
  if (def.controller().empty()) return absl::InvalidArgumentError("control graph names no controller");
  if (def.hosts().empty()) return absl::InvalidArgumentError("control graph names no hosts");
  std::vector<std::string> hosts(def.hosts().begin(), def.hosts().end());
  for (const std::string& h : hosts) {
    if (h.empty()) return absl::InvalidArgumentError("control graph names a host without an address");
  }
  if (std::set<std::string>(hosts.begin(), hosts.end()).size() != hosts.size()) {
    return absl::InvalidArgumentError("control graph names a host twice");
  }
  auto graph = std::make_shared<GraphDef>(ControlGraphName(def));
  using L = ControlGraphLayout;
  const std::vector<std::string> controller{def.controller()};
  const std::vector<std::string> controller_per_host(hosts.size(), def.controller());
  // Added in the layout's order, so the ids are the layout's.
  if (*graph->AddNode("schedule", controller) != L::kSchedule ||
      *graph->AddNode("apply", hosts) != L::kApply ||
      *graph->AddNode("accepted", controller_per_host) != L::kAccepted ||
      *graph->AddNode("report", hosts) != L::kReport ||
      *graph->AddNode("done", controller_per_host) != L::kDone ||
      *graph->AddEdge(L::kSchedule, L::kApply, EdgeKind::kAnnounced) != L::kToHosts ||
      *graph->AddEdge(L::kApply, L::kAccepted, EdgeKind::kOneToOne) != L::kAcks ||
      *graph->AddEdge(L::kReport, L::kDone, EdgeKind::kOneToOne) != L::kReports) {
    return absl::InternalError("control graph layout is inconsistent");
  }
  return graph;
}

std::string EncodeScheduled(int32_t host_shard, const rpc::ScheduledOp& op) {
  std::string payload(sizeof(host_shard), '\0');
  std::memcpy(payload.data(), &host_shard, sizeof(host_shard));
  op.AppendToString(&payload);
  return payload;
}

absl::StatusOr<std::pair<int32_t, std::string>> DecodeScheduled(const std::string& payload) {
  int32_t shard = 0;
  if (payload.size() < sizeof(shard)) return absl::InvalidArgumentError("scheduled op payload is too short");
  std::memcpy(&shard, payload.data(), sizeof(shard));
  return std::make_pair(shard, payload.substr(sizeof(shard)));
}

}  // namespace pathways::dataflow
