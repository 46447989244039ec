// The shape of a sharded dataflow: nodes are sharded operators (one node whatever the number of
// shards, each shard placed on a host) and edges say which producer shards feed which consumer
// shards.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pathways::dataflow {

enum class EdgeKind {
  kOneToOne,  // producer shard i feeds consumer shard i only
  kAllToAll,  // every producer shard feeds every consumer shard
  kSparse,    // a producer shard sends to any subset of consumer shards, chosen at run time
  // As kSparse, but an epoch reaches only the consumer shards sent something in it: the one
  // producer shard punctuates those alone, and the others never hear of the epoch. For fan-out
  // whose cost must follow the shards an epoch involves, not the graph's size (the island
  // control graph: a scheduling round wakes the hosts it has ops for, not the whole island).
  // Needs a producer node of one shard, so that a consumer that hears of an epoch knows it has
  // heard from everyone. Its consumer node, and the nodes fed one-to-one from it, see only some
  // epochs: they take no other edge in, and give only one-to-one edges out (a shard of theirs
  // that never hears of an epoch could not punctuate it).
  kAnnounced,
};

struct NodeDef {
  std::string name;
  std::vector<std::string> shard_hosts;  // host of each shard
};

struct EdgeDef {
  int from;
  int to;
  EdgeKind kind;
};

// Immutable once built and shared by every host's engine. Not thread-safe while being built.
class GraphDef {
 public:
  explicit GraphDef(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  absl::StatusOr<int> AddNode(std::string name, std::vector<std::string> shard_hosts);
  // Edges go from earlier to later nodes, so the graph is acyclic by construction.
  absl::StatusOr<int> AddEdge(int from, int to, EdgeKind kind);

  const std::vector<NodeDef>& nodes() const { return nodes_; }
  const std::vector<EdgeDef>& edges() const { return edges_; }
  int num_shards(int node) const { return static_cast<int>(nodes_[node].shard_hosts.size()); }
  const std::vector<int>& in_edges(int node) const { return in_edges_[node]; }
  const std::vector<int>& out_edges(int node) const { return out_edges_[node]; }
  // How many producer shards feed each consumer shard over `edge`.
  int producers_per_consumer(int edge) const;

 private:
  std::string name_;
  std::vector<NodeDef> nodes_;
  std::vector<EdgeDef> edges_;
  std::vector<std::vector<int>> in_edges_, out_edges_;
  std::vector<bool> partial_;  // per node: sees only the epochs announced to it (see kAnnounced)
};

}  // namespace pathways::dataflow
