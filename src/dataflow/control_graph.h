// The island control graph: the dataflow through which an island's gang scheduler (in the
// controller) reaches the island's hosts, and through which they answer.
//
//   schedule [controller] --announced--> apply [host k] --one-to-one--> accepted [controller, one shard per host]
//   report [host k] --one-to-one--> done [controller, one shard per host]
//
// One epoch of schedule/apply/accepted is one scheduling round: the ops the scheduler released
// together. `schedule` sends each op to the apply shard of the host it is for, and the round
// reaches only those hosts (an announced edge): a round costs what the hosts it has ops for cost,
// whatever the island's size. Each such host's apply shard learns when it has all of the round
// (counted punctuations), and its `accepted` shard learns it next: the controller counts the
// round's hosts off as they do, which is the round's acknowledgement, with no message of its own.
// `report` carries what hosts report back (runs done, for proportional share); each host numbers
// its report epochs itself, so hosts never wait on each other there.
//
// A graph serves one membership generation of the island: when hosts join or leave, the
// controller starts the next generation, and the new graph names the new hosts.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "dataflow/graph.h"
#include "proto/pathways.pb.h"

namespace pathways::dataflow {

struct ControlGraphLayout {
  // Nodes.
  static constexpr int kSchedule = 0;
  static constexpr int kApply = 1;
  static constexpr int kAccepted = 2;
  static constexpr int kReport = 3;
  static constexpr int kDone = 4;
  // Edges.
  static constexpr int kToHosts = 0;   // schedule -> apply: the round's ops
  static constexpr int kAcks = 1;      // apply -> accepted: punctuations only
  static constexpr int kReports = 2;   // report -> done
};

// Every island control graph's name starts so (DataflowService holds their early batches apart).
inline constexpr char kControlGraphPrefix[] = "island-control/";
std::string ControlGraphName(const rpc::ControlGraph& def);
// InvalidArgument for a definition without hosts, with a host twice, or without a controller.
absl::StatusOr<std::shared_ptr<const GraphDef>> MakeControlGraph(const rpc::ControlGraph& def);

// What `schedule` is given for one op: the apply shard it goes to, then the op.
std::string EncodeScheduled(int32_t host_shard, const rpc::ScheduledOp& op);
// The shard, and the op's bytes (what `apply` receives).
absl::StatusOr<std::pair<int32_t, std::string>> DecodeScheduled(const std::string& payload);

}  // namespace pathways::dataflow
