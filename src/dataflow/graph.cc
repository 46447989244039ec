#include "dataflow/graph.h"

#include "absl/strings/str_cat.h"

namespace pathways::dataflow {

absl::StatusOr<int> GraphDef::AddNode(std::string name, std::vector<std::string> shard_hosts) {
  if (shard_hosts.empty()) return absl::InvalidArgumentError(absl::StrCat("node '", name, "' has no shards"));
  for (const auto& h : shard_hosts) {
    if (h.empty()) return absl::InvalidArgumentError(absl::StrCat("node '", name, "' has a shard without a host"));
  }
  nodes_.push_back({std::move(name), std::move(shard_hosts)});
  in_edges_.emplace_back();
  out_edges_.emplace_back();
  partial_.push_back(false);
  return static_cast<int>(nodes_.size()) - 1;
}

absl::StatusOr<int> GraphDef::AddEdge(int from, int to, EdgeKind kind) {
  const int n = static_cast<int>(nodes_.size());
  if (from < 0 || to < 0 || from >= n || to >= n) {
    return absl::InvalidArgumentError(absl::StrCat("edge ", from, " -> ", to, " names a node that does not exist"));
  }
  if (from >= to) return absl::InvalidArgumentError("edges must go from an earlier node to a later one");
  if (kind == EdgeKind::kOneToOne && num_shards(from) != num_shards(to)) {
    return absl::InvalidArgumentError(absl::StrCat("one-to-one edge between nodes of ", num_shards(from), " and ",
                                                   num_shards(to), " shards"));
  }
  if (kind == EdgeKind::kAnnounced && num_shards(from) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("announced edge from node '", nodes_[from].name, "' of ",
                                                   num_shards(from), " shards (it takes one)"));
  }
  const bool makes_partial = kind == EdgeKind::kAnnounced || partial_[from];
  if (partial_[from] && kind != EdgeKind::kOneToOne) {
    return absl::InvalidArgumentError(absl::StrCat("node '", nodes_[from].name,
                                                   "' sees only announced epochs: its edges out must be one-to-one"));
  }
  if ((makes_partial && !in_edges_[to].empty()) || partial_[to]) {
    return absl::InvalidArgumentError(absl::StrCat("node '", nodes_[to].name,
                                                   "' would see only announced epochs on one edge in and every "
                                                   "epoch on another"));
  }
  partial_[to] = makes_partial;
  edges_.push_back({from, to, kind});
  const int e = static_cast<int>(edges_.size()) - 1;
  out_edges_[from].push_back(e);
  in_edges_[to].push_back(e);
  return e;
}

int GraphDef::producers_per_consumer(int edge) const {
  const EdgeDef& e = edges_[edge];
  return e.kind == EdgeKind::kOneToOne ? 1 : num_shards(e.from);
}

}  // namespace pathways::dataflow
