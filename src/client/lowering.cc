// Lowering: a traced program and its arguments' placements become the ProgramProto that hosts
// register and run, with physical devices for every virtual slice.
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_core.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"

namespace pathways {

namespace {

PartitionSpec OrReplicated(const std::vector<PartitionSpec>& specs, size_t i, const Shape& shape) {
  return specs.empty() ? PartitionSpec(shape.size(), "") : specs[i];
}

rpc::PartitionSpecProto ToProto(const PartitionSpec& spec, size_t rank) {
  rpc::PartitionSpecProto p;
  for (size_t d = 0; d < rank; ++d) p.add_dims(spec.empty() ? "" : spec[d]);
  return p;
}

void AddHosts(const SliceMapping& mapping, std::vector<std::string>& hosts) {
  for (const std::string& h : mapping.hosts) {
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<ClientCore::Lowering>> ClientCore::Lower(const Program& program,
                                                                        absl::Span<const ShardedArray> args) {
  // Lowered for these placements: where each argument is, and where each call's slice maps now.
  // Remapping a slice gives it a new mapping, so its programs are lowered again.
  std::vector<std::shared_ptr<const SliceMapping>> node_mappings;
  for (const Program::Call& c : program.calls()) node_mappings.push_back(c.slice.mapping());
  std::string key = absl::StrCat(program.id().value());
  for (const ShardedArray& a : args) {
    absl::StrAppend(&key, "|", a.state_->placed_on->id.value(), PartitionSpecToString(a.sharding().spec()));
  }
  absl::StrAppend(&key, "|");
  for (const auto& m : node_mappings) absl::StrAppend(&key, m->id.value(), ",");
  {
    absl::MutexLock lock(&mu_);
    auto it = lowerings_cache_.find(key);
    if (it != lowerings_cache_.end()) return it->second;
  }
  auto lowering = std::make_shared<Lowering>();
  lowering->id = lowered_program_ids_.Next();
  rpc::ProgramProto& proto = lowering->proto;
  proto.set_program_id(lowering->id.value());
  proto.set_name(program.name());
  // Slices in the lowered program are mappings: an argument placed before a remap and a call on
  // the remapped slice are on different devices.
  std::map<MappingId, std::pair<const Mesh*, std::shared_ptr<const SliceMapping>>> slices;
  for (const ShardedArray& a : args) slices.emplace(a.state_->placed_on->id, std::make_pair(&a.slice().mesh(), a.state_->placed_on));
  for (size_t n = 0; n < program.calls().size(); ++n) {
    const Program::Call& c = program.calls()[n];
    if (c.slice.data_->owner != serial()) {
      return absl::InvalidArgumentError(absl::StrCat("program '", program.name(), "' calls '", c.function.name(),
                                                     "' on a slice that this client did not create"));
    }
    if (c.function.state_->owner != serial()) {
      return absl::InvalidArgumentError(absl::StrCat("program '", program.name(), "' calls '", c.function.name(),
                                                     "', which this client did not compile"));
    }
    slices.emplace(node_mappings[n]->id, std::make_pair(&c.slice.mesh(), node_mappings[n]));
  }
  for (const auto& [id, slice] : slices) {
    const auto& [mesh, mapping] = slice;
    rpc::SliceProto* sp = proto.add_slices();
    sp->set_slice_id(id.value());
    for (int64_t d : mesh->dims) sp->add_mesh_dims(d);
    for (const std::string& n : mesh->axis_names) sp->add_axis_names(n);
    for (const PhysicalDeviceInfo& d : mapping->devices) {
      rpc::SliceDevice* sd = sp->add_devices();
      sd->set_device_id(static_cast<int32_t>(d.device_id.value()));
      sd->set_host_address(d.host_address);
      sd->set_local_index(d.local_index);
      sd->set_island(d.island);
    }
    AddHosts(*mapping, lowering->hosts);
  }
  for (const ShardedArray& a : args) {
    rpc::ProgramArg* pa = proto.add_args();
    *pa->mutable_spec() = pathways::ToProto(a.spec());
    pa->set_slice_id(a.state_->placed_on->id.value());
    *pa->mutable_sharding() = ToProto(a.sharding().spec(), a.spec().shape.size());
  }
  auto value_mapping = [&](const Program::Value& v) -> const SliceMapping& {
    return v.is_arg ? *args[v.index].state_->placed_on : *node_mappings[v.index];
  };
  for (size_t n = 0; n < program.calls().size(); ++n) {
    const Program::Call& c = program.calls()[n];
    const FunctionSpec& spec = c.function.spec();
    const std::string name = spec.body.DisplayName();
    rpc::ProgramNode* node = proto.add_nodes();
    node->set_function_key(c.function.state_->key);
    node->set_function_name(name);
    node->set_slice_id(node_mappings[n]->id.value());
    std::vector<std::string> hosts;
    AddHosts(*node_mappings[n], hosts);
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      rpc::ValueRef* v = node->add_inputs();
      v->set_is_arg(c.inputs[i].is_arg);
      v->set_index(c.inputs[i].index);
      v->set_output(c.inputs[i].output);
      *node->add_input_specs() = pathways::ToProto(spec.inputs[i]);
      PartitionSpec in = OrReplicated(spec.in_shardings, i, spec.inputs[i].shape);
      auto sharding = Sharding::Create(c.slice.mesh(), in, spec.inputs[i].shape);
      if (!sharding.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name, "' input ", i, ": ", sharding.status().message()));
      }
      *node->add_in_shardings() = ToProto(in, spec.inputs[i].shape.size());
      AddHosts(value_mapping(c.inputs[i]), hosts);
    }
    std::vector<Sharding> outs;
    for (size_t j = 0; j < spec.outputs.size(); ++j) {
      *node->add_output_specs() = pathways::ToProto(spec.outputs[j]);
      PartitionSpec out = OrReplicated(spec.out_shardings, j, spec.outputs[j].shape);
      auto sharding = Sharding::Create(c.slice.mesh(), out, spec.outputs[j].shape);
      if (!sharding.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("function '", name, "' output ", j, ": ", sharding.status().message()));
      }
      *node->add_out_shardings() = ToProto(out, spec.outputs[j].shape.size());
      outs.push_back(*std::move(sharding));
    }
    node->set_data_dependent(c.data_dependent_shapes);
    if (!spec.donated_inputs.empty()) {
      for (int donor : spec.OutputDonors()) node->add_output_donors(donor);
    }
    lowering->out_shardings.push_back(std::move(outs));
    lowering->output_offsets.push_back(lowering->num_outputs);
    lowering->num_outputs += static_cast<int64_t>(spec.outputs.size());
    lowering->node_hosts.push_back(std::move(hosts));
  }
  lowering->node_mappings = std::move(node_mappings);
  for (const Program::Value& r : program.results()) {
    rpc::ValueRef* v = proto.add_results();
    v->set_index(r.index);
    v->set_output(r.output);
  }
  CountLowering();
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = lowerings_cache_.emplace(key, lowering);
  return it->second;
}

absl::StatusOr<Program> ClientCore::OneNodeProgram(const CompiledFunction& function, const VirtualSlice& slice) {
  std::pair<const void*, SliceId> key{function.state_.get(), slice.id()};
  {
    absl::MutexLock lock(&mu_);
    auto it = one_node_programs_.find(key);
    if (it != one_node_programs_.end()) return it->second;
  }
  ProgramBuilder builder(function.name());
  std::vector<TracedValue> args;
  for (const TensorSpec& spec : function.spec().inputs) args.push_back(builder.Arg(spec));
  PW_ASSIGN_OR_RETURN(std::vector<TracedValue> outputs, builder.Call(function, slice, args));
  PW_ASSIGN_OR_RETURN(Program program, builder.Build(outputs));
  absl::MutexLock lock(&mu_);
  return one_node_programs_.emplace(key, program).first->second;
}

absl::StatusOr<std::string> Client::DescribeLowering(const Program& program, absl::Span<const ShardedArray> args) {
  PW_ASSIGN_OR_RETURN(std::shared_ptr<ClientCore::Lowering> lowering, core_->Lower(program, args));
  const rpc::ProgramProto& p = lowering->proto;
  std::string out = absl::StrCat("lowered program ", p.name(), " (id ", p.program_id(), ") on ",
                                 lowering->hosts.size(), " hosts\n");
  for (const rpc::SliceProto& s : p.slices()) {
    std::map<std::string, std::vector<int64_t>> by_host;
    for (int64_t i = 0; i < s.devices_size(); ++i) by_host[s.devices(i).host_address()].push_back(i);
    absl::StrAppend(&out, "  slice ", s.slice_id(), ": ", s.devices_size(), " devices\n");
    for (const auto& [host, shards] : by_host) {
      absl::StrAppend(&out, "    ", host, ": shards ", shards.front(), "..", shards.back(), " (", shards.size(), ")\n");
    }
  }
  for (int n = 0; n < p.nodes_size(); ++n) {
    absl::StrAppend(&out, "  node ", n, " ", p.nodes(n).function_name(), " on slice ", p.nodes(n).slice_id(),
                    ", set up by ", absl::StrJoin(lowering->node_hosts[n], " "), "\n");
  }
  return out;
}

}  // namespace pathways
