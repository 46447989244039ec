#include "worker/lowered_program.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

constexpr int kMaxNodes = 1 << 20;
constexpr int kMaxSliceDevices = 1 << 20;

PartitionSpec ToSpec(const rpc::PartitionSpecProto& p) { return PartitionSpec(p.dims().begin(), p.dims().end()); }

absl::StatusOr<Sharding> MakeSharding(const Mesh& mesh, const rpc::PartitionSpecProto& p, const TensorSpec& spec,
                                      const std::string& what) {
  auto s = Sharding::Create(mesh, ToSpec(p), spec.shape);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.status().message()));
  return s;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const LoweredProgram>> LoweredProgram::Create(
    const rpc::ProgramProto& proto, const std::string& host, int num_local_devices) {
  auto program = std::make_shared<LoweredProgram>();
  program->id_ = proto.program_id();
  program->name_ = proto.name();
  if (proto.nodes_size() > kMaxNodes) return absl::InvalidArgumentError("program has too many nodes");

  for (const rpc::SliceProto& sp : proto.slices()) {
    LoweredSlice slice;
    PW_ASSIGN_OR_RETURN(slice.mesh, Mesh::Create(std::vector<int64_t>(sp.mesh_dims().begin(), sp.mesh_dims().end()),
                                                 std::vector<std::string>(sp.axis_names().begin(), sp.axis_names().end()),
                                                 kMaxSliceDevices));
    if (slice.mesh.num_devices() != sp.devices_size()) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", sp.slice_id(), " has ", sp.devices_size(),
                                                     " devices for mesh ", slice.mesh.ToString()));
    }
    absl::flat_hash_set<int32_t> device_ids;
    for (int64_t i = 0; i < sp.devices_size(); ++i) {
      const rpc::SliceDevice& d = sp.devices(i);
      // Planning takes a slice's shards to be on distinct devices (a block whose source and
      // destination share a device id stays put), so a slice naming one twice is refused.
      if (!device_ids.insert(d.device_id()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("slice ", sp.slice_id(), " names device ", d.device_id(), " twice"));
      }
      slice.devices.push_back({DeviceId(d.device_id()), d.host_address()});
      if (std::find(slice.hosts.begin(), slice.hosts.end(), d.host_address()) == slice.hosts.end()) {
        slice.hosts.push_back(d.host_address());
      }
      if (d.host_address() == host) {
        if (d.local_index() < 0 || d.local_index() >= num_local_devices) {
          return absl::InvalidArgumentError(absl::StrCat("slice ", sp.slice_id(), " places shard ", i,
                                                         " on device ", d.local_index(), " of ", host,
                                                         ", which has ", num_local_devices, " devices"));
        }
        slice.local_devices.push_back(d.local_index());
        slice.local_shards.push_back(i);
      } else {
        slice.local_devices.push_back(-1);
      }
    }
    for (const std::string& h : slice.hosts) {
      if (std::find(program->hosts_.begin(), program->hosts_.end(), h) == program->hosts_.end()) {
        program->hosts_.push_back(h);
      }
    }
    if (!program->slices_.emplace(sp.slice_id(), std::move(slice)).second) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", sp.slice_id(), " is listed twice"));
    }
  }
  auto find_slice = [&](int64_t id) -> absl::StatusOr<const LoweredSlice*> {
    auto it = program->slices_.find(id);
    if (it == program->slices_.end()) return absl::InvalidArgumentError(absl::StrCat("unknown slice ", id));
    return &it->second;
  };

  for (int i = 0; i < proto.args_size(); ++i) {
    const rpc::ProgramArg& a = proto.args(i);
    LoweredArg arg;
    PW_ASSIGN_OR_RETURN(arg.spec, FromProto(a.spec()));
    PW_ASSIGN_OR_RETURN(arg.slice, find_slice(a.slice_id()));
    PW_ASSIGN_OR_RETURN(arg.sharding, MakeSharding(arg.slice->mesh, a.sharding(), arg.spec, absl::StrCat("argument ", i)));
    program->args_.push_back(std::move(arg));
  }

  int64_t offset = 0;
  for (int n = 0; n < proto.nodes_size(); ++n) {
    const rpc::ProgramNode& pn = proto.nodes(n);
    const std::string what = absl::StrCat("node ", n, " ('", pn.function_name(), "')");
    LoweredNode node;
    node.function_key = pn.function_key();
    node.function_name = pn.function_name();
    PW_ASSIGN_OR_RETURN(node.slice, find_slice(pn.slice_id()));
    if (pn.inputs_size() != pn.input_specs_size() || pn.inputs_size() != pn.in_shardings_size() ||
        pn.output_specs_size() != pn.out_shardings_size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": inputs, outputs and their shardings differ in number"));
    }
    for (int i = 0; i < pn.inputs_size(); ++i) {
      const rpc::ValueRef& v = pn.inputs(i);
      PW_ASSIGN_OR_RETURN(TensorSpec spec, FromProto(pn.input_specs(i)));
      TensorSpec produced;
      if (v.is_arg()) {
        if (v.index() < 0 || v.index() >= static_cast<int>(program->args_.size())) {
          return absl::InvalidArgumentError(absl::StrCat(what, " input ", i, " names argument ", v.index()));
        }
        produced = program->args_[v.index()].spec;
      } else {
        if (v.index() < 0 || v.index() >= n || v.output() < 0 ||
            v.output() >= static_cast<int>(program->nodes_[v.index()].output_specs.size())) {
          return absl::InvalidArgumentError(absl::StrCat(what, " input ", i, " names output ", v.output(),
                                                         " of node ", v.index(), ", which is not an earlier node's output"));
        }
        produced = program->nodes_[v.index()].output_specs[v.output()];
      }
      if (produced != spec) {
        return absl::InvalidArgumentError(absl::StrCat(what, " input ", i, " expects ", spec.ToString(),
                                                       " but is given ", produced.ToString()));
      }
      node.inputs.push_back({v.is_arg(), v.index(), v.output()});
      node.input_specs.push_back(spec);
      PW_ASSIGN_OR_RETURN(Sharding s, MakeSharding(node.slice->mesh, pn.in_shardings(i), spec, absl::StrCat(what, " input ", i)));
      node.in_shardings.push_back(std::move(s));
    }
    for (int j = 0; j < pn.output_specs_size(); ++j) {
      PW_ASSIGN_OR_RETURN(TensorSpec spec, FromProto(pn.output_specs(j)));
      PW_ASSIGN_OR_RETURN(Sharding s, MakeSharding(node.slice->mesh, pn.out_shardings(j), spec, absl::StrCat(what, " output ", j)));
      node.output_specs.push_back(spec);
      node.out_shardings.push_back(std::move(s));
    }
    if (pn.output_donors_size() != 0 && pn.output_donors_size() != pn.output_specs_size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", pn.output_donors_size(), " output donors for ",
                                                     pn.output_specs_size(), " outputs"));
    }
    std::vector<int> donated_args;
    for (int j = 0; j < pn.output_donors_size(); ++j) {
      const int donor = pn.output_donors(j);
      node.output_donors.push_back(donor);
      if (donor == -1) continue;
      if (donor < 0 || donor >= pn.inputs_size() ||
          std::count(pn.output_donors().begin(), pn.output_donors().end(), donor) > 1) {
        return absl::InvalidArgumentError(absl::StrCat(what, " output ", j, " takes the buffer of input ", donor,
                                                       ", which is not one input given to one output"));
      }
      if (node.input_specs[donor].dtype != node.output_specs[j].dtype ||
          node.in_shardings[donor].local_shape() != node.out_shardings[j].local_shape()) {
        return absl::InvalidArgumentError(absl::StrCat(what, " output ", j, " takes the buffer of input ", donor,
                                                       ", whose shards differ from its own"));
      }
      if (node.inputs[donor].is_arg) donated_args.push_back(node.inputs[donor].index);
    }
    if (std::count(node.output_donors.begin(), node.output_donors.end(), -1) ==
        static_cast<std::ptrdiff_t>(node.output_donors.size())) {
      node.output_donors.clear();  // empty: the node takes no donated buffer
    }
    program->args_donated_to_.push_back(std::move(donated_args));
    node.output_offset = offset;
    offset += pn.output_specs_size();
    program->nodes_.push_back(std::move(node));
  }
  // An intermediate lives until the op holding its last consumer is set up: consumers take their
  // own references then. A data-dependent node's outputs stay until the run's last op, because
  // the client waits on them between ops. Results (-1) are the client's to free.
  const int num_nodes = proto.nodes_size();
  std::vector<std::vector<int>> last_use(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    last_use[n].assign(proto.nodes(n).output_specs_size(), proto.nodes(n).data_dependent() ? num_nodes - 1 : n);
    for (const LoweredValue& v : program->nodes_[n].inputs) {
      if (!v.is_arg) last_use[v.index][v.output] = std::max(last_use[v.index][v.output], n);
    }
  }
  for (const rpc::ValueRef& r : proto.results()) {
    if (r.is_arg() || r.index() < 0 || r.index() >= num_nodes || r.output() < 0 ||
        r.output() >= static_cast<int>(last_use[r.index()].size())) {
      return absl::InvalidArgumentError("a program result must name an output of one of its nodes");
    }
    last_use[r.index()][r.output()] = -1;
  }
  program->dropped_after_.resize(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    for (size_t j = 0; j < last_use[n].size(); ++j) {
      if (last_use[n][j] >= 0) {
        program->dropped_after_[last_use[n][j]].push_back(program->nodes_[n].output_offset + static_cast<int64_t>(j));
      }
    }
  }
  return std::shared_ptr<const LoweredProgram>(std::move(program));
}

Placement LoweredProgram::PlacementOf(const LoweredValue& v) const {
  if (v.is_arg) return {&args_[v.index].sharding, &args_[v.index].slice->devices};
  const LoweredNode& p = nodes_[v.index];
  return {&p.out_shardings[v.output], &p.slice->devices};
}

}  // namespace pathways
