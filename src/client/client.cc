#include "client/client.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/client_core.h"
#include "client/function_spec.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/auth.h"
#include "transport/rpc_util.h"

namespace pathways {

// ---- VirtualSlice, CompiledFunction, ShardedArray ----

std::shared_ptr<const SliceMapping> VirtualSlice::mapping() const {
  absl::MutexLock lock(&data_->mu);
  return data_->mappings.back();
}

std::string VirtualSlice::ToString() const {
  std::vector<std::string> devices;
  for (const auto& d : this->devices()) {
    devices.push_back(absl::StrCat("d", d.device_id.value(), "@h", d.host_id.value()));
  }
  return absl::StrCat("slice ", id().value(), " mesh ", mesh().ToString(), " [", absl::StrJoin(devices, " "), "]");
}

const std::string& CompiledFunction::name() const { return state_->spec.body.name; }
const FunctionSpec& CompiledFunction::spec() const { return state_->spec; }

ArrayId ShardedArray::id() const { return state_->id; }
const TensorSpec& ShardedArray::spec() const { return state_->spec; }
const Sharding& ShardedArray::sharding() const { return state_->sharding; }
const VirtualSlice& ShardedArray::slice() const { return state_->slice; }
std::string ShardedArray::ToString() const {
  return absl::StrCat("array ", id().value(), " ", spec().ToString(), " sharded ",
                      PartitionSpecToString(sharding().spec()), " over ", slice().ToString());
}

// ---- Client ----

Client::Client(std::shared_ptr<ClientCore> core) : core_(std::move(core)) {}
Client::~Client() {
  if (core_ != nullptr) core_->PushHeldFrees();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& controller_address,
                                                         const ClientOptions& options) {
  if (!(options.weight > 0) || options.weight > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("client weight ", options.weight, " is not in (0, 1e6]"));
  }
  // A program that set up no TLS itself (the pathways binary does, from its flags) gets it from
  // PATHWAYS_TLS_CA (and _CERT, _KEY), before its first channel is made.
  if (!TlsConfigured()) PW_RETURN_IF_ERROR(ConfigureTls({}));
  PW_RETURN_IF_ERROR(CheckTokenCanTravel(
      TokenOr(options.token), options.token.has_value() ? "the client's options" : "the process (SetCallToken or PATHWAYS_TOKEN)"));
  auto core = std::make_shared<ClientCore>(controller_address, options);
  // A server that answers but knows no controller's methods (a worker's port, say) is named as such.
  auto named = [&](absl::Status s) {
    if (!absl::IsUnimplemented(s)) return s;
    return absl::UnimplementedError(absl::StrCat(controller_address, " is not a controller (it does not serve ",
                                                 "the controller's methods", s.message().empty() ? "" : ": ",
                                                 s.message(), "); a worker's address, perhaps?"));
  };
  PW_RETURN_IF_ERROR(named(core->StartLease()));
  PW_RETURN_IF_ERROR(named(core->controller().GetStatus().status()));
  return std::unique_ptr<Client>(new Client(std::move(core)));
}

const std::string& Client::id() const { return core_->id(); }

absl::StatusOr<std::string> Client::DescribeCluster() {
  PW_ASSIGN_OR_RETURN(rpc::ClusterStatus status, core_->controller().GetStatus());
  std::string out;
  for (const auto& h : status.hosts()) {
    absl::StrAppendFormat(&out, "island %d  host %d  %s  %s  (heartbeat %d ms ago)\n", h.island(),
                          h.host_id(), h.address(), h.alive() ? "alive" : "DEAD",
                          h.millis_since_heartbeat());
    for (const auto& d : h.devices()) {
      absl::StrAppendFormat(&out, "    device %d  %s:%d  at (%s) in the island  memory %d / %d bytes  ran %d\n",
                            d.device_id(), d.kind(), d.local_index(), absl::StrJoin(d.coords(), ","), d.memory_used(),
                            d.memory_capacity(), d.executed());
    }
  }
  return out;
}

absl::StatusOr<VirtualSlice> Client::CreateSlice(const SliceSpec& spec) {
  PW_ASSIGN_OR_RETURN(Mesh mesh, Mesh::Create(spec.mesh_shape, spec.axis_names));
  rpc::AllocateSliceRequest request;
  for (int64_t d : mesh.dims) request.add_mesh_shape(d);
  if (spec.island.has_value()) {
    request.set_has_island(true);
    request.set_island(*spec.island);
  }
  request.set_span_islands(spec.span_islands);
  request.set_client_id(core_->id());
  request.set_credential(core_->credential());
  request.set_min_free_memory_bytes(spec.min_free_memory_bytes);
  request.set_device_kind(spec.device_kind);
  PW_ASSIGN_OR_RETURN(rpc::AllocateSliceResponse response, core_->controller().AllocateSlice(request));
  if (response.devices_size() != mesh.num_devices()) {
    return absl::InternalError(absl::StrCat("controller placed ", response.devices_size(),
                                            " devices for a mesh of ", mesh.num_devices()));
  }
  auto data = std::make_shared<VirtualSlice::Data>();
  data->id = SliceId(response.slice_id());
  data->mesh = std::move(mesh);
  data->owner = core_->serial();
  std::shared_ptr<const SliceMapping> mapping = core_->NewMapping(response);
  {
    absl::MutexLock lock(&data->mu);  // not shared yet, but mappings are guarded
    data->mappings.push_back(std::move(mapping));
  }
  VirtualSlice slice;
  slice.data_ = std::move(data);
  return slice;
}

absl::StatusOr<std::vector<Client::LostSlice>> Client::LostSlices() {
  rpc::SliceStatesRequest request;
  request.set_client_id(core_->id());
  request.set_credential(core_->credential());
  PW_ASSIGN_OR_RETURN(rpc::SliceStatesResponse response, core_->controller().SliceStates(request));
  std::vector<LostSlice> lost;
  for (const rpc::SliceState& s : response.slices()) {
    if (s.lost()) lost.push_back({SliceId(s.slice_id()), s.reason()});
  }
  return lost;
}

absl::Status Client::RemapSlice(const VirtualSlice& slice) {
  if (!slice.data_ || slice.data_->owner != core_->serial()) {
    return absl::InvalidArgumentError("RemapSlice of a slice that this client did not create");
  }
  rpc::RemapSliceRequest request;
  request.set_client_id(core_->id());
  request.set_credential(core_->credential());
  request.set_slice_id(slice.id().value());
  PW_ASSIGN_OR_RETURN(rpc::AllocateSliceResponse response, core_->controller().RemapSlice(request));
  if (response.devices_size() != slice.num_devices()) {
    return absl::InternalError(absl::StrCat("controller remapped ", response.devices_size(), " devices for a mesh of ",
                                            slice.num_devices()));
  }
  std::shared_ptr<const SliceMapping> mapping = core_->NewMapping(response);
  // Data is shared and otherwise immutable; its list of mappings is the one thing that changes.
  auto& data = const_cast<VirtualSlice::Data&>(*slice.data_);
  absl::MutexLock lock(&data.mu);
  data.mappings.push_back(std::move(mapping));
  return absl::OkStatus();
}


absl::StatusOr<CompiledFunction> Client::Compile(const FunctionSpec& spec) {
  PW_RETURN_IF_ERROR(ValidateFunctionSpec(spec));
  PW_ASSIGN_OR_RETURN(rpc::ClusterStatus status, core_->controller().GetStatus());
  std::vector<std::string> hosts;
  for (const auto& h : status.hosts()) {
    if (h.alive()) hosts.push_back(h.address());
  }
  if (hosts.empty()) return absl::UnavailableError("the cluster has no live workers to compile on");
  CompiledFunction fn;
  fn.state_ = std::make_shared<CompiledFunction::State>();
  fn.state_->spec = spec;
  fn.state_->key = FunctionKey(spec.body);
  fn.state_->owner = core_->serial();
  PW_RETURN_IF_ERROR(core_->CompileOn(*fn.state_, hosts));
  return fn;
}

absl::StatusOr<ShardedArray> Client::Put(const HostArray& data, const VirtualSlice& slice,
                                         const PartitionSpec& partition) {
  return PutBytes(data.spec(), data.bytes().data(), nullptr, slice, partition);
}

absl::StatusOr<ShardedArray> Client::Put(HostArray&& data, const VirtualSlice& slice, const PartitionSpec& partition) {
  const TensorSpec spec = data.spec();
  auto whole = std::make_shared<std::string>(std::move(data.mutable_bytes()));
  return PutBytes(spec, whole->data(), whole, slice, partition);
}

absl::StatusOr<ShardedArray> Client::PutBytes(const TensorSpec& spec, const char* bytes,
                                              std::shared_ptr<std::string> whole, const VirtualSlice& slice,
                                              const PartitionSpec& partition) {
  if (!slice.data_ || slice.data_->owner != core_->serial()) {
    return absl::InvalidArgumentError("Put onto a slice that this client did not create");
  }
  PW_RETURN_IF_ERROR(CheckTensorSpec(spec, "Put"));
  PW_ASSIGN_OR_RETURN(Sharding sharding, Sharding::Create(slice.mesh(), partition, spec.shape));
  auto state = std::make_shared<ShardedArray::State>(core_, core_->NextArrayId(), spec, sharding, slice,
                                                     slice.mapping());
  const size_t element = DTypeSize(spec.dtype);
  const size_t shard_bytes = static_cast<size_t>(*ByteSize(spec.dtype, sharding.local_shape()));
  // A shard larger than its device's whole memory could never be placed: say so now, not at the
  // array's first use.
  for (const PhysicalDeviceInfo& dev : state->placed_on->devices) {
    if (dev.memory_capacity > 0 && shard_bytes > static_cast<size_t>(dev.memory_capacity)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Put of ", DTypeName(spec.dtype), ShapeToString(spec.shape), ": a shard of ", shard_bytes,
          " bytes is larger than the whole memory of device ", dev.device_id.value(), " (", dev.memory_capacity,
          " bytes, host ", dev.host_address, "); split the array over more devices with a partition spec"));
    }
  }
  for (int64_t s = 0; s < slice.num_devices(); ++s) {
    const PhysicalDeviceInfo& dev = state->placed_on->devices[s];
    Region region = sharding.ShardRegion(s);
    rpc::Op op;
    rpc::PutOp* put = op.mutable_put();
    put->mutable_dest()->set_array_id(state->id.value());
    put->mutable_dest()->set_shard(static_cast<int32_t>(s));
    put->set_local_device(dev.local_index);
    *put->mutable_spec() = ToProto(TensorSpec{spec.dtype, sharding.local_shape()});
    std::shared_ptr<std::string> shard;
    if (sharding.local_shape() == spec.shape) {
      if (whole == nullptr) whole = std::make_shared<std::string>(bytes, shard_bytes);
      shard = whole;
    } else {
      std::string region_bytes(shard_bytes, '\0');
      CopyRegion(bytes, spec.shape, region.start, region.size, element, region_bytes.data(), sharding.local_shape(),
                 Shape(region.size.size(), 0));
      shard = std::make_shared<std::string>(std::move(region_bytes));
    }
    (*state->produced_at)[dev.host_address] = core_->PushPut(dev.host_address, std::move(op), std::move(shard));  // the last shard's
  }
  ShardedArray array;
  array.state_ = std::move(state);
  return array;
}

namespace {

using Segment = ClientCore::Lowering::Segment;

// The ops a run of `program` is pushed as (see Lowering::Segment).
std::vector<Segment> MakeSegments(ClientCore& core, const Program& program, const ClientCore::Lowering& lowering,
                                  bool sequential) {
  std::vector<Segment> segments;
  const int num_nodes = static_cast<int>(program.calls().size());
  int first = 0;
  for (int n = 0; n < num_nodes; ++n) {
    const bool data_dependent = program.calls()[n].data_dependent_shapes;
    if (!sequential && !data_dependent && n + 1 < num_nodes) continue;
    std::vector<std::string> hosts;
    absl::flat_hash_set<std::string> seen;
    for (int m = first; m <= n; ++m) {
      for (const std::string& h : lowering.node_hosts[m]) {
        if (seen.insert(h).second) hosts.push_back(h);
      }
    }
    segments.push_back({first, n, data_dependent, core.GroupFor(hosts)});
    first = n + 1;
  }
  return segments;
}

// Pushes a run's segments one after another: each once the previous one is enqueued on all its
// hosts (or computed, after a data-dependent node). Holds the run's outputs until the last is
// pushed.
struct SegmentedDispatch {
  std::shared_ptr<ClientCore> core;
  rpc::RunProgramOp op;
  std::vector<Segment> segments;
  std::vector<std::vector<std::shared_ptr<const ShardedArray::State>>> node_outputs;
  // The run's arguments, until its last op is pushed: an argument the caller drops is freed
  // behind every op that reads it, not between two of the run's ops.
  std::vector<std::shared_ptr<const ShardedArray::State>> args;
  // Shared with the outputs' states; complete when `done` is set.
  std::shared_ptr<std::map<std::string, SeqRef>> produced_at = std::make_shared<std::map<std::string, SeqRef>>();
  std::shared_ptr<std::vector<RunPlace>> run_places = std::make_shared<std::vector<RunPlace>>();
  Promise<Unit> done;       // every segment pushed
  Promise<Unit> delivered;  // every segment on its hosts, or why one never will be
  std::vector<Future<Unit>> deliveries;

  static void Next(std::shared_ptr<SegmentedDispatch> d, size_t k) {
    const Segment& seg = d->segments[k];
    {
      // Each op is one epoch of the program's dataflow. Hosts require a client's epochs to arrive
      // in increasing order, so numbering and pushing happen together.
      absl::MutexLock lock(&d->core->epoch_mu());
      const Epoch epoch = d->core->NextEpoch();
      rpc::RunProgramOp op = d->op;
      op.set_first_node(seg.first);
      op.set_last_node(seg.last);
      op.set_epoch(epoch.value());
      ClientCore::PushedRun pushed = d->core->PushRun(seg.group, op);
      if (pushed.place.has_value()) d->run_places->push_back(*pushed.place);
      for (const auto& [host, seq] : pushed.seqs) (*d->produced_at)[host] = seq;
      d->deliveries.push_back(pushed.delivered);
    }
    if (k + 1 == d->segments.size()) {
      d->args.clear();
      // From here the outputs live as long as their handles, not until the run is delivered: a
      // loop's dropped array is freed while the runs after it are on their way (ClientCore::Free).
      d->node_outputs.clear();
      d->done.Set(Unit{});
      AllDone(d->deliveries).OnReady([d](const absl::StatusOr<Unit>& r) { d->delivered.Set(r); });
      return;
    }
    std::vector<Future<Unit>> waits;
    if (seg.wait_until_computed) {
      for (const auto& out : d->node_outputs[seg.last]) waits.push_back(ShardsReady(d->core, out));
    } else {
      waits.push_back(d->deliveries.back());
    }
    AllDone(waits).OnReady([d, k](const absl::StatusOr<Unit>& r) {
      if (!r.ok()) {
        d->done.Set(r.status());
        d->delivered.Set(r.status());
        return;
      }
      Next(d, k + 1);
    });
  }
};

}  // namespace

absl::Status Client::CheckArrays(const std::string& what, const char* noun,
                                 const std::vector<TensorSpec>& specs,
                                 absl::Span<const ShardedArray> arrays) const {
  if (arrays.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " takes ", specs.size(), " ", noun, "s, got ", arrays.size()));
  }
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (!Owns(arrays[i])) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", noun, " ", i, " is not an array of this client"));
    }
    if (arrays[i].state_->donated.load()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", noun, " ", i, " (array ", arrays[i].id().value(),
                                                     ") was donated to an earlier call and is no longer valid"));
    }
    if (arrays[i].spec() != specs[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", noun, " ", i, " must be ", specs[i].ToString(),
                                                     ", got ", arrays[i].spec().ToString()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::shared_ptr<const ShardedArray::State>>> Client::Donate(
    const std::string& what, const std::vector<int>& positions, absl::Span<const ShardedArray> arrays) {
  std::vector<std::shared_ptr<const ShardedArray::State>> spent;
  auto restore = [&spent] {
    for (const auto& s : spent) s->donated.store(false);
  };
  for (int p : positions) {
    const auto& state = arrays[p].state_;
    for (size_t i = 0; i < arrays.size(); ++i) {
      if (static_cast<int>(i) != p && arrays[i].state_ == state) {
        restore();
        return absl::InvalidArgumentError(absl::StrCat(what, " is given array ", state->id.value(), " at ", p,
                                                       ", a donated position, and again at ", i));
      }
    }
    if (state->donated.exchange(true)) {  // another thread donated it meanwhile
      restore();
      return absl::InvalidArgumentError(
          absl::StrCat(what, " input ", p, " (array ", state->id.value(), ") was donated to another call"));
    }
    spent.push_back(state);
  }
  for (const auto& s : spent) s->AwaitReads();
  return spent;
}

absl::StatusOr<std::vector<ShardedArray>> Client::Run(const Program& program, absl::Span<const ShardedArray> args,
                                                      const RunOptions& options) {
  const std::string what = absl::StrCat("program '", program.name(), "'");
  PW_RETURN_IF_ERROR(CheckArrays(what, "argument", program.arg_specs(), args));
  PW_ASSIGN_OR_RETURN(auto spent, Donate(what, program.donated_args(), args));
  auto results = RunChecked(program, args, options);
  if (!results.ok()) {
    for (const auto& s : spent) s->donated.store(false);
  }
  return results;
}

absl::StatusOr<std::vector<ShardedArray>> Client::RunChecked(const Program& program,
                                                             absl::Span<const ShardedArray> args,
                                                             const RunOptions& options) {
  PW_ASSIGN_OR_RETURN(std::shared_ptr<ClientCore::Lowering> lowering, core_->Lower(program, args));

  // An argument still being dispatched by a sequential run: wait until its op is pushed, so
  // this run's ops follow it in every host's queue.
  for (const ShardedArray& a : args) {
    if (!a.state_->dispatched.IsReady()) PW_RETURN_IF_ERROR(a.state_->dispatched.Await().status());
  }
  // The first run of a lowering compiles what hosts that joined after Compile lack and registers
  // the program on every host; later runs skip straight to dispatch.
  if (!lowering->ready.load(std::memory_order_acquire)) {
    for (size_t n = 0; n < program.calls().size(); ++n) {
      const Program::Call& c = program.calls()[n];
      std::vector<std::string> missing;
      {
        absl::MutexLock lock(&c.function.state_->mu);
        for (const std::string& host : lowering->node_mappings[n]->hosts) {
          if (!c.function.state_->compiled_on.contains(core_->HostKey(host))) missing.push_back(host);
        }
      }
      if (!missing.empty()) PW_RETURN_IF_ERROR(core_->CompileOn(*c.function.state_, missing));
    }
    absl::MutexLock lock(&lowering->mu);
    for (const std::string& host : lowering->hosts) {
      if (!lowering->registered_on.insert(host).second) continue;
      rpc::Op op;
      *op.mutable_register_program()->mutable_program() = lowering->proto;
      core_->Push(host, std::move(op));
    }
    lowering->ready.store(true, std::memory_order_release);
  }

  const int num_nodes = static_cast<int>(program.calls().size());
  const bool sequential = options.dispatch == RunOptions::Dispatch::kSequential;
  std::vector<Segment> segments;
  {
    absl::MutexLock lock(&lowering->mu);
    std::vector<Segment>& made = lowering->segments[sequential ? 1 : 0];
    if (made.empty()) made = MakeSegments(*core_, program, *lowering, sequential);
    segments = made;
  }

  auto dispatch = std::make_shared<SegmentedDispatch>();
  dispatch->core = core_;
  rpc::RunProgramOp& op = dispatch->op;
  op.set_program_id(lowering->id.value());
  op.set_run_id(core_->NextRunId().value());
  for (const ShardedArray& a : args) op.add_arg_array_ids(a.id().value());
  const ArrayId base = core_->ReserveArrayIds(lowering->num_outputs);
  op.set_output_array_base(base.value());
  op.set_num_output_arrays(lowering->num_outputs);
  dispatch->segments = std::move(segments);
  if (dispatch->segments.size() > 1) {
    for (const ShardedArray& a : args) dispatch->args.push_back(a.state_);
  }
  // With one segment (parallel dispatch, no data-dependent node) this is ready when Run returns.
  Future<Unit> dispatched = dispatch->done.future();
  // Handles only for what someone waits on: the results, and data-dependent nodes' outputs that
  // the dispatch waits for. Intermediates have none; the hosts drop them once the run is done
  // with them.
  std::set<std::pair<int, int>> result_values;
  for (const Program::Value& v : program.results()) result_values.insert({v.index, v.output});
  dispatch->node_outputs.resize(num_nodes);
  for (int n = 0; n < num_nodes; ++n) {
    const Program::Call& c = program.calls()[n];
    for (size_t j = 0; j < c.function.spec().outputs.size(); ++j) {
      const bool result = result_values.contains({n, static_cast<int>(j)});
      if (!result && !c.data_dependent_shapes) continue;
      auto state = std::make_shared<ShardedArray::State>(
          core_, base + lowering->output_offsets[n] + static_cast<int64_t>(j), c.function.spec().outputs[j],
          lowering->out_shardings[n][j], c.slice, lowering->node_mappings[n]);
      state->dispatched = dispatched;
      state->delivered = dispatch->delivered.future();
      state->produced_at = dispatch->produced_at;
      state->run_places = dispatch->run_places;
      state->owned = result;
      dispatch->node_outputs[n].push_back(std::move(state));
    }
  }
  std::vector<ShardedArray> results;
  for (const Program::Value& v : program.results()) {
    ShardedArray r;
    for (const auto& state : dispatch->node_outputs[v.index]) {
      if (state->id == base + lowering->output_offsets[v.index] + v.output) r.state_ = state;
    }
    results.push_back(std::move(r));
  }
  SegmentedDispatch::Next(std::move(dispatch), 0);
  return results;
}

ClientStats Client::stats() const { return core_->stats(); }

absl::StatusOr<std::vector<ShardedArray>> Client::Call(const CompiledFunction& function, const VirtualSlice& slice,
                                                       absl::Span<const ShardedArray> inputs) {
  if (!function.state_ || function.state_->owner != core_->serial()) {
    return absl::InvalidArgumentError("Call of a function that this client did not compile");
  }
  if (!slice.data_ || slice.data_->owner != core_->serial()) {
    return absl::InvalidArgumentError("Call on a slice that this client did not create");
  }
  const std::string what = absl::StrCat("function '", function.name(), "'");
  PW_RETURN_IF_ERROR(CheckArrays(what, "input", function.spec().inputs, inputs));
  // OpByOp is a one-node program, traced once per (function, slice) and then reused, so its
  // lowering is cached like any program's.
  PW_ASSIGN_OR_RETURN(Program program, core_->OneNodeProgram(function, slice));
  PW_ASSIGN_OR_RETURN(auto spent, Donate(what, function.spec().donated_inputs, inputs));
  auto results = RunChecked(program, inputs, {});  // the inputs were just checked against the same specs
  if (!results.ok()) {
    for (const auto& s : spent) s->donated.store(false);
  }
  return results;
}

}  // namespace pathways
