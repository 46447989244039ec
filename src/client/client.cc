#include "client/client.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/client_core.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"

namespace pathways {
namespace {

// One replica per distinct region of a sharding: the shards a full read needs.
std::vector<int64_t> DistinctShards(const Sharding& sharding) {
  std::vector<int64_t> shards;
  std::vector<Region> seen;
  for (int64_t s = 0; s < sharding.num_shards(); ++s) {
    Region r = sharding.ShardRegion(s);
    if (std::find(seen.begin(), seen.end(), r) != seen.end()) continue;
    seen.push_back(r);
    shards.push_back(s);
  }
  return shards;
}

absl::Status CheckSpec(const TensorSpec& spec, const std::string& what) {
  auto size = ByteSize(spec.dtype, spec.shape);
  if (!size.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", size.status().message()));
  return absl::OkStatus();
}

}  // namespace

// ---- VirtualSlice, CompiledFunction, ShardedArray ----

std::shared_ptr<const SliceMapping> VirtualSlice::mapping() const {
  absl::MutexLock lock(&data_->mu);
  return data_->mappings.back();
}

std::string VirtualSlice::ToString() const {
  std::vector<std::string> devices;
  for (const auto& d : this->devices()) {
    devices.push_back(absl::StrCat("d", d.device_id, "@h", d.host_id));
  }
  return absl::StrCat("slice ", id(), " mesh ", mesh().ToString(), " [", absl::StrJoin(devices, " "), "]");
}

FunctionSpec FunctionSpec::Builtin(std::string kernel, std::vector<TensorSpec> inputs,
                                   std::vector<TensorSpec> outputs,
                                   std::vector<PartitionSpec> in_shardings,
                                   std::vector<PartitionSpec> out_shardings) {
  return FunctionSpec{{FunctionBody::Kind::kBuiltin, std::move(kernel), ""},
                      std::move(inputs), std::move(outputs), std::move(in_shardings),
                      std::move(out_shardings)};
}

FunctionSpec FunctionSpec::Script(std::string name, std::string source,
                                  std::vector<TensorSpec> inputs, std::vector<TensorSpec> outputs,
                                  std::vector<PartitionSpec> in_shardings,
                                  std::vector<PartitionSpec> out_shardings) {
  return FunctionSpec{{FunctionBody::Kind::kTorchScript, std::move(name), std::move(source)},
                      std::move(inputs), std::move(outputs), std::move(in_shardings),
                      std::move(out_shardings)};
}

const std::string& CompiledFunction::name() const { return state_->spec.body.name; }
const FunctionSpec& CompiledFunction::spec() const { return state_->spec; }

ArrayId ShardedArray::id() const { return state_->id; }
const TensorSpec& ShardedArray::spec() const { return state_->spec; }
const Sharding& ShardedArray::sharding() const { return state_->sharding; }
const VirtualSlice& ShardedArray::slice() const { return state_->slice; }
std::string ShardedArray::ToString() const {
  return absl::StrCat("array ", id(), " ", spec().ToString(), " sharded ",
                      PartitionSpecToString(sharding().spec()), " over ", slice().ToString());
}

// ---- Client ----

Client::Client(std::shared_ptr<ClientCore> core) : core_(std::move(core)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& controller_address,
                                                         const ClientOptions& options) {
  if (!(options.weight > 0) || options.weight > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("client weight ", options.weight, " is not in (0, 1e6]"));
  }
  auto core = std::make_shared<ClientCore>(controller_address, options);
  PW_RETURN_IF_ERROR(core->StartLease());
  PW_RETURN_IF_ERROR(core->controller().GetStatus().status());
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
  request.set_min_free_memory_bytes(spec.min_free_memory_bytes);
  request.set_device_kind(spec.device_kind);
  PW_ASSIGN_OR_RETURN(rpc::AllocateSliceResponse response, core_->controller().AllocateSlice(request));
  if (response.devices_size() != mesh.num_devices()) {
    return absl::InternalError(absl::StrCat("controller placed ", response.devices_size(),
                                            " devices for a mesh of ", mesh.num_devices()));
  }
  auto data = std::make_shared<VirtualSlice::Data>();
  data->id = response.slice_id();
  data->mesh = std::move(mesh);
  data->owner = core_.get();
  data->mappings.push_back(core_->NewMapping(response));
  VirtualSlice slice;
  slice.data_ = std::move(data);
  return slice;
}

absl::StatusOr<std::vector<Client::LostSlice>> Client::LostSlices() {
  rpc::SliceStatesRequest request;
  request.set_client_id(core_->id());
  PW_ASSIGN_OR_RETURN(rpc::SliceStatesResponse response, core_->controller().SliceStates(request));
  std::vector<LostSlice> lost;
  for (const rpc::SliceState& s : response.slices()) {
    if (s.lost()) lost.push_back({s.slice_id(), s.reason()});
  }
  return lost;
}

absl::Status Client::RemapSlice(const VirtualSlice& slice) {
  if (!slice.data_ || slice.data_->owner != core_.get()) {
    return absl::InvalidArgumentError("RemapSlice of a slice that this client did not create");
  }
  rpc::RemapSliceRequest request;
  request.set_client_id(core_->id());
  request.set_slice_id(slice.id());
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

std::shared_ptr<const SliceMapping> ClientCore::NewMapping(const rpc::AllocateSliceResponse& response) {
  auto mapping = std::make_shared<SliceMapping>();
  mapping->id = mapping_ids_.Next();
  for (const auto& d : response.devices()) {
    mapping->devices.push_back({d.device_id(), d.host_id(), d.host_address(), d.local_index(), d.island(),
                                std::vector<int32_t>(d.coords().begin(), d.coords().end()), d.incarnation()});
    NoteHost(d.host_address(), d.incarnation());
    if (std::find(mapping->hosts.begin(), mapping->hosts.end(), d.host_address()) == mapping->hosts.end()) {
      mapping->hosts.push_back(d.host_address());
    }
  }
  return mapping;
}

namespace {

absl::Status ValidateFunctionSpec(const FunctionSpec& spec) {
  const std::string& name = spec.body.name;
  if (name.empty()) return absl::InvalidArgumentError("a function needs a name");
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    PW_RETURN_IF_ERROR(CheckSpec(spec.inputs[i], absl::StrCat("function '", name, "' input ", i)));
  }
  for (size_t i = 0; i < spec.outputs.size(); ++i) {
    PW_RETURN_IF_ERROR(CheckSpec(spec.outputs[i], absl::StrCat("function '", name, "' output ", i)));
  }
  if (!spec.in_shardings.empty() && spec.in_shardings.size() != spec.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' has ", spec.inputs.size(),
                                                   " inputs but ", spec.in_shardings.size(),
                                                   " input shardings"));
  }
  if (!spec.out_shardings.empty() && spec.out_shardings.size() != spec.outputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' has ", spec.outputs.size(),
                                                   " outputs but ", spec.out_shardings.size(),
                                                   " output shardings"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ClientCore::StartLease() {
  PW_ASSIGN_OR_RETURN(absl::Duration interval, controller_->ClientHeartbeat(id_, /*goodbye=*/false));
  lease_thread_ = std::thread([this, interval] { LeaseLoop(interval); });
  return absl::OkStatus();
}

void ClientCore::LeaseLoop(absl::Duration interval) {
  while (!lease_stop_.WaitForNotificationWithTimeout(interval)) {
    auto next = controller_->ClientHeartbeat(id_, /*goodbye=*/false);
    if (next.ok()) {
      interval = *next;
    } else {
      PW_LOG(Warning) << "client " << id_ << " could not renew its lease: " << next.status();
    }
  }
  (void)controller_->ClientHeartbeat(id_, /*goodbye=*/true);
}

ClientCore::~ClientCore() {
  if (!lease_thread_.joinable()) return;
  lease_stop_.Notify();
  lease_thread_.join();
}

std::shared_ptr<OrderedBatchQueue<rpc::GangRun>> ClientCore::ScheduleQueue() {
  absl::MutexLock lock(&mu_);
  auto& q = schedule_queue_;
  if (q == nullptr) {
    q = std::make_shared<OrderedBatchQueue<rpc::GangRun>>(
        [controller = controller_, id = id_, weight = options_.weight](std::vector<rpc::GangRun> runs) {
          rpc::ScheduleRequest request;
          request.set_client_id(id);
          request.set_weight(weight);
          for (rpc::GangRun& r : runs) *request.add_runs() = std::move(r);
          return controller->Schedule(request).Then([](const rpc::ScheduleResponse&) { return Unit{}; });
        },
        // A refused batch (a host left, say) fails its runs only. Their sequence numbers are
        // filled with no-ops on the hosts still there, which would otherwise wait for them.
        [weak = weak_from_this()](std::vector<rpc::GangRun> runs, const absl::Status& status) {
          PW_LOG(Warning) << runs.size() << " runs refused by the scheduler: " << status;
          auto core = weak.lock();
          if (core == nullptr) return;
          for (const rpc::GangRun& run : runs) {
            for (const rpc::HostSeq& h : run.hosts()) {
              auto q = core->queue(h.host());
              if (q->session() == h.session()) q->SkipReserved(h.seq());  // else that sequence is gone
            }
          }
        });
  }
  return q;
}

ClientCore::PushedRun ClientCore::PushRun(const std::vector<std::string>& hosts, const rpc::RunProgramOp& op) {
  PushedRun pushed;
  std::map<std::string, SeqRef>& seqs = pushed.seqs;
  std::vector<Future<Unit>> deliveries;
  if (options_.TEST_bypass_scheduler) {
    for (const std::string& host : hosts) {
      rpc::Op o;
      *o.mutable_run() = op;
      seqs[host] = Push(host, std::move(o));
      deliveries.push_back(queue(host)->Flushed());
    }
    pushed.delivered = AllDone(deliveries);
    return pushed;
  }
  // One message for the run, whichever islands it spans: the controller splits it, and orders
  // runs over several islands across them.
  rpc::GangRun run;
  *run.mutable_run() = op;
  for (const std::string& host : hosts) {
    rpc::HostSeq* h = run.add_hosts();
    h->set_host(host);
    std::shared_ptr<HostOpQueue> q = queue(host);
    seqs[host] = {q->session(), q->ReserveSeq()};
    h->set_seq(seqs[host].seq);
    h->set_session(seqs[host].session);
  }
  run_ops_sent_.fetch_add(1, std::memory_order_relaxed);
  run_op_bytes_sent_.fetch_add(static_cast<int64_t>(run.ByteSizeLong()), std::memory_order_relaxed);
  auto queue = ScheduleQueue();
  queue->Push(std::move(run));
  deliveries.push_back(queue->Flushed());  // covers this run's batch
  pushed.delivered = AllDone(deliveries);
  return pushed;
}

absl::Status ClientCore::CompileOn(CompiledFunction::State& fn,
                                   const std::vector<std::string>& hosts) {
  rpc::CompileRequest request;
  request.mutable_body()->set_kind(static_cast<int>(fn.spec.body.kind));
  request.mutable_body()->set_name(fn.spec.body.name);
  request.mutable_body()->set_source(fn.spec.body.source);
  std::vector<Future<rpc::CompileResponse>> calls;
  for (const std::string& host : hosts) calls.push_back(worker(host)->Compile(request));
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto& r = calls[i].Await();
    if (!r.ok()) return r.status();
    if (r->function_key() != fn.key) {
      return absl::InternalError(absl::StrCat("host ", hosts[i], " named function '",
                                              fn.spec.body.name, "' ", r->function_key(),
                                              ", expected ", fn.key));
    }
    absl::MutexLock lock(&fn.mu);
    fn.compiled_on.insert(HostKey(hosts[i]));
  }
  return absl::OkStatus();
}

// The State struct is private to CompiledFunction; Client is a friend, so it reaches it here.
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
  fn.state_->owner = core_.get();
  PW_RETURN_IF_ERROR(core_->CompileOn(*fn.state_, hosts));
  return fn;
}

absl::StatusOr<ShardedArray> Client::Put(const HostArray& data, const VirtualSlice& slice,
                                         const PartitionSpec& partition) {
  if (!slice.data_ || slice.data_->owner != core_.get()) {
    return absl::InvalidArgumentError("Put onto a slice that this client did not create");
  }
  PW_RETURN_IF_ERROR(CheckSpec(data.spec(), "Put"));
  PW_ASSIGN_OR_RETURN(Sharding sharding, Sharding::Create(slice.mesh(), partition, data.shape()));
  auto state = std::make_shared<ShardedArray::State>(core_, core_->NextArrayId(), data.spec(), sharding, slice,
                                                     slice.mapping());
  const size_t element = DTypeSize(data.dtype());
  for (int64_t s = 0; s < slice.num_devices(); ++s) {
    const PhysicalDeviceInfo& dev = state->placed_on->devices[s];
    Region region = sharding.ShardRegion(s);
    rpc::Op op;
    rpc::PutOp* put = op.mutable_put();
    put->mutable_dest()->set_array_id(state->id);
    put->mutable_dest()->set_shard(static_cast<int32_t>(s));
    put->set_local_device(dev.local_index);
    *put->mutable_spec() = ToProto(TensorSpec{data.dtype(), sharding.local_shape()});
    std::string* bytes = put->mutable_data();
    bytes->resize(static_cast<size_t>(*ByteSize(data.dtype(), sharding.local_shape())));
    CopyRegion(data.bytes().data(), data.shape(), region.start, region.size, element, bytes->data(),
               sharding.local_shape(), Shape(region.size.size(), 0));
    (*state->produced_at)[dev.host_address] = core_->Push(dev.host_address, std::move(op));  // the last shard's
  }
  ShardedArray array;
  array.state_ = std::move(state);
  return array;
}

namespace {

// Completes when every shard of the array is computed. Assumes the producing op was pushed.
Future<Unit> ShardsReady(const std::shared_ptr<ClientCore>& core,
                         const std::shared_ptr<const ShardedArray::State>& state);

struct Segment {
  int first;
  int last;
  bool wait_until_computed;  // the last node declares data-dependent shapes
  std::vector<std::string> hosts;  // hosts that run, hold or send anything for its nodes
};

// Pushes a run's segments one after another: each once the previous one is enqueued on all its
// hosts (or computed, after a data-dependent node). Holds the run's outputs until the end.
struct SegmentedDispatch {
  std::shared_ptr<ClientCore> core;
  rpc::RunProgramOp op;
  std::vector<Segment> segments;
  std::vector<std::vector<std::shared_ptr<const ShardedArray::State>>> node_outputs;
  // Shared with the outputs' states; complete when `done` is set.
  std::shared_ptr<std::map<std::string, SeqRef>> produced_at = std::make_shared<std::map<std::string, SeqRef>>();
  Promise<Unit> done;       // every segment pushed
  Promise<Unit> delivered;  // every segment on its hosts, or why one never will be
  std::vector<Future<Unit>> deliveries;

  static void Next(std::shared_ptr<SegmentedDispatch> d, size_t k) {
    const Segment& seg = d->segments[k];
    {
      // Each op is one epoch of the program's dataflow. Hosts require a client's epochs to arrive
      // in increasing order, so numbering and pushing happen together.
      absl::MutexLock lock(&d->core->epoch_mu());
      const int64_t epoch = d->core->NextRunId();
      rpc::RunProgramOp op = d->op;
      op.set_first_node(seg.first);
      op.set_last_node(seg.last);
      op.set_epoch(epoch);
      ClientCore::PushedRun pushed = d->core->PushRun(seg.hosts, op);
      for (const auto& [host, seq] : pushed.seqs) (*d->produced_at)[host] = seq;
      d->deliveries.push_back(pushed.delivered);
    }
    if (k + 1 == d->segments.size()) {
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
    if (arrays[i].spec() != specs[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", noun, " ", i, " must be ", specs[i].ToString(),
                                                     ", got ", arrays[i].spec().ToString()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ShardedArray>> Client::Run(const Program& program, absl::Span<const ShardedArray> args,
                                                      const RunOptions& options) {
  PW_RETURN_IF_ERROR(CheckArrays(absl::StrCat("program '", program.name(), "'"), "argument",
                                 program.arg_specs(), args));
  return RunChecked(program, args, options);
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
  std::vector<Segment> segments;
  const bool sequential = options.dispatch == RunOptions::Dispatch::kSequential;
  int first = 0;
  for (int n = 0; n < num_nodes; ++n) {
    const bool data_dependent = program.calls()[n].data_dependent_shapes;
    if (sequential || data_dependent || n + 1 == num_nodes) {
      Segment seg{first, n, data_dependent, {}};
      for (int m = first; m <= n; ++m) {
        for (const std::string& h : lowering->node_hosts[m]) {
          if (std::find(seg.hosts.begin(), seg.hosts.end(), h) == seg.hosts.end()) seg.hosts.push_back(h);
        }
      }
      segments.push_back(std::move(seg));
      first = n + 1;
    }
  }

  auto dispatch = std::make_shared<SegmentedDispatch>();
  dispatch->core = core_;
  rpc::RunProgramOp& op = dispatch->op;
  op.set_program_id(lowering->id);
  op.set_run_id(core_->NextRunId());
  for (const ShardedArray& a : args) op.add_arg_array_ids(a.id());
  const ArrayId base = core_->ReserveArrayIds(lowering->num_outputs);
  op.set_output_array_base(base);
  dispatch->segments = std::move(segments);
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
  if (!function.state_ || function.state_->owner != core_.get()) {
    return absl::InvalidArgumentError("Call of a function that this client did not compile");
  }
  if (!slice.data_ || slice.data_->owner != core_.get()) {
    return absl::InvalidArgumentError("Call on a slice that this client did not create");
  }
  PW_RETURN_IF_ERROR(CheckArrays(absl::StrCat("function '", function.name(), "'"), "input",
                                 function.spec().inputs, inputs));
  // OpByOp is a one-node program, traced once per (function, slice) and then reused, so its
  // lowering is cached like any program's.
  PW_ASSIGN_OR_RETURN(Program program, core_->OneNodeProgram(function, slice));
  return RunChecked(program, inputs, {});  // the inputs were just checked against the same specs
}

namespace {

// Fetches the given shards from `host` once it has applied op `seq` (which produced them), the
// client's direct ops to it flushed first: that surfaces a refused batch instead of waiting for
// ops that never come.
Future<rpc::FetchResponse> FetchFromHost(ClientCore& core, const std::string& host, std::optional<SeqRef> at,
                                         rpc::FetchRequest request) {
  std::shared_ptr<WorkerClient> worker = core.worker(host);
  std::shared_ptr<HostOpQueue> queue = core.queue(host);
  if (!at.has_value()) at = SeqRef{queue->session(), queue->last_seq()};
  if (at->session != queue->session()) {
    // The sequence the array was made in broke (the host died or refused ops); what it held there
    // is gone with it.
    return Future<rpc::FetchResponse>::Ready(absl::UnavailableError(
        absl::StrCat("host ", host, " stopped taking this client's ops after array ", request.array_id(),
                     " was made there (it left or restarted); its shards there are gone")));
  }
  request.set_after_seq(at->seq);
  request.set_session(at->session);
  return queue->Flushed().FlatThen(
      [worker, request = std::move(request)](const Unit&) { return worker->Fetch(request); });
}

// The distinct shards of an array that a full read needs, fetched from their hosts.
Future<std::vector<rpc::FetchResponse>> FetchShards(const std::shared_ptr<ClientCore>& core,
                                                    const ShardedArray::State& state,
                                                    const std::vector<int64_t>& shards, bool status_only) {
  std::map<std::string, std::vector<int32_t>> by_host;
  std::map<std::string, std::string> incarnation;
  for (int64_t s : shards) {
    const PhysicalDeviceInfo& d = state.placed_on->devices[s];
    by_host[d.host_address].push_back(static_cast<int32_t>(s));
    incarnation[d.host_address] = d.incarnation;
  }
  std::vector<Future<rpc::FetchResponse>> responses;
  for (auto& [host, host_shards] : by_host) {
    rpc::FetchRequest request;
    request.set_client_id(core->id());
    request.set_array_id(state.id);
    request.set_status_only(status_only);
    request.set_incarnation(incarnation[host]);
    for (int32_t s : host_shards) request.add_shards(s);
    auto at = state.produced_at->find(host);
    responses.push_back(FetchFromHost(*core, host,
                                      at == state.produced_at->end() ? std::nullopt : std::optional<SeqRef>(at->second),
                                      std::move(request)));
  }
  return JoinAll(responses);
}

std::vector<int64_t> AllShards(const Sharding& sharding) {
  std::vector<int64_t> all(static_cast<size_t>(sharding.num_shards()));
  for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int64_t>(s);
  return all;
}

Future<Unit> ShardsReady(const std::shared_ptr<ClientCore>& core,
                         const std::shared_ptr<const ShardedArray::State>& state) {
  // Holding the state keeps the shards alive until the answer is in.
  return FetchShards(core, *state, AllShards(state->sharding), /*status_only=*/true)
      .Then([state](const std::vector<rpc::FetchResponse>&) { return Unit{}; });
}

absl::StatusOr<HostArray> Assemble(const ShardedArray::State& state, const std::vector<rpc::FetchResponse>& all) {
  PW_ASSIGN_OR_RETURN(HostArray out, HostArray::Create(state.spec.dtype, state.spec.shape));
  const Shape& local = state.sharding.local_shape();
  const TensorSpec expected{state.spec.dtype, local};
  for (const rpc::FetchResponse& response : all) {
    for (const rpc::ShardData& shard : response.shards()) {
      if (shard.shard() < 0 || shard.shard() >= state.sharding.num_shards()) {
        return absl::InternalError(absl::StrCat("worker returned unknown shard ", shard.shard()));
      }
      PW_ASSIGN_OR_RETURN(TensorSpec got, FromProto(shard.spec()));
      if (got != expected || static_cast<int64_t>(shard.data().size()) != *ByteSize(got.dtype, got.shape)) {
        return absl::InternalError(absl::StrCat("worker returned shard ", shard.shard(), " as ", got.ToString(),
                                                ", expected ", expected.ToString()));
      }
      Region region = state.sharding.ShardRegion(shard.shard());
      CopyRegion(shard.data().data(), local, Shape(local.size(), 0), local, DTypeSize(got.dtype),
                 out.mutable_bytes().data(), out.shape(), region.start);
    }
  }
  return out;
}

}  // namespace

// Both wait until the array's producing op has reached its hosts (sequential runs push late; a
// run the scheduler refused fails here with its reason).
bool Client::Owns(const ShardedArray& array) const {
  return array.state_ != nullptr && array.state_->core.get() == core_.get();
}

absl::Status Client::CheckOwned(const ShardedArray& array, const char* what) const {
  if (!Owns(array)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of an array that is not this client's"));
  }
  return absl::OkStatus();
}

Future<HostArray> Client::Fetch(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Fetch"); !s.ok()) return Future<HostArray>::Ready(s);
  auto core = core_;
  auto state = array.state_;
  return state->delivered
      .FlatThen([core, state](const Unit&) {
        return FetchShards(core, *state, DistinctShards(state->sharding), /*status_only=*/false);
      })
      .Then([state](const std::vector<rpc::FetchResponse>& all) { return Assemble(*state, all); });
}

Future<Unit> Client::Enqueued(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Enqueued"); !s.ok()) return Future<Unit>::Ready(s);
  return array.state_->delivered;
}

Future<Unit> Client::Ready(const ShardedArray& array) {
  if (absl::Status s = CheckOwned(array, "Ready"); !s.ok()) return Future<Unit>::Ready(s);
  auto core = core_;
  auto state = array.state_;
  return state->delivered.FlatThen([core, state](const Unit&) { return ShardsReady(core, state); });
}

}  // namespace pathways
