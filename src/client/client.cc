#include "client/client.h"

#include <atomic>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/program.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/controller_client.h"
#include "transport/rpc_util.h"
#include "transport/worker_client.h"

namespace pathways {

// Shared by the Client and every handle it gave out, so handles can free their shards even after
// the Client object is gone. Thread-safe.
class ClientCore {
 public:
  explicit ClientCore(std::string controller_address)
      : id_(RandomIdString()), controller_(std::move(controller_address)) {}

  const std::string& id() const { return id_; }
  ControllerClient& controller() { return controller_; }
  std::shared_ptr<WorkerClient> worker(const std::string& address) {
    return WorkerClientCache::Global().Get(address);
  }

  std::shared_ptr<HostOpQueue> queue(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto& q = queues_[address];
    if (!q) q = std::make_shared<HostOpQueue>(worker(address), id_);
    return q;
  }

  // Compiles the function on each host in parallel and waits for all; the first error wins.
  absl::Status CompileOn(CompiledFunction::State& fn, const std::vector<std::string>& hosts);

  ArrayId NextArrayId() { return array_ids_.Next(); }
  absl::Mutex& epoch_mu() { return epoch_mu_; }
  // A contiguous block of `n` array ids (a run's outputs are named base + offset on the hosts).
  ArrayId ReserveArrayIds(int64_t n) { return array_ids_.Reserve(n); }
  int64_t NextRunId() { return run_ids_.Next(); }

  // Every op the client sends goes through here, so the stats see all of them.
  void Push(const std::string& host, rpc::Op op) {
    const int64_t bytes = static_cast<int64_t>(op.ByteSizeLong());
    ops_sent_.fetch_add(1, std::memory_order_relaxed);
    op_bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
    if (op.has_run()) {
      run_ops_sent_.fetch_add(1, std::memory_order_relaxed);
      run_op_bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
    }
    queue(host)->Push(std::move(op));
  }
  // OpByOp calls run as one-node programs, traced once per (function, slice).
  absl::StatusOr<Program> OneNodeProgram(const CompiledFunction& function, const VirtualSlice& slice);

  ClientStats stats() const {
    return {ops_sent_.load(), op_bytes_sent_.load(), run_ops_sent_.load(), run_op_bytes_sent_.load(),
            lowerings_.load()};
  }
  void CountLowering() { lowerings_.fetch_add(1); }

  // Lowered programs by program id and argument placement.
  struct Lowering;
  absl::StatusOr<std::shared_ptr<Lowering>> Lower(const Program& program,
                                                  absl::Span<const ShardedArray> args);

 private:
  const std::string id_;
  ControllerClient controller_;
  IdGenerator array_ids_;
  IdGenerator run_ids_;
  absl::Mutex epoch_mu_;
  std::atomic<int64_t> ops_sent_{0}, op_bytes_sent_{0}, run_ops_sent_{0}, run_op_bytes_sent_{0}, lowerings_{0};
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<HostOpQueue>> queues_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Lowering>> lowerings_cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<const void*, int64_t>, Program> one_node_programs_ ABSL_GUARDED_BY(mu_);
};

struct CompiledFunction::State {
  FunctionSpec spec;
  std::string key;
  const ClientCore* owner;
  absl::Mutex mu;
  absl::flat_hash_set<std::string> compiled_on ABSL_GUARDED_BY(mu);  // host addresses
};

struct ShardedArray::State {
  State(std::shared_ptr<ClientCore> core, ArrayId id, TensorSpec spec, Sharding sharding, VirtualSlice slice)
      : core(std::move(core)), id(id), spec(std::move(spec)), sharding(std::move(sharding)), slice(std::move(slice)) {}
  // One State per logical array: a copy would free the array twice.
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  std::shared_ptr<ClientCore> core;
  ArrayId id;
  TensorSpec spec;
  Sharding sharding;
  VirtualSlice slice;
  // Ready once the op producing the array has been pushed to its hosts' queues. Immediate except
  // under sequential dispatch, where a run's later nodes are pushed as earlier ones are enqueued.
  Future<Unit> dispatched = Future<Unit>::Ready(Unit{});
  // False for a run's intermediates, which the hosts free themselves.
  bool owned = true;

  // Freeing goes through each host's ordered queue, behind every op that still reads the array.
  ~State() {
    if (!owned) return;
    auto free = [core = core, id = id, hosts = slice.host_addresses()](const absl::StatusOr<Unit>&) {
      for (const std::string& host : hosts) {
        rpc::Op op;
        op.mutable_free()->set_array_id(id);
        core->Push(host, std::move(op));
      }
    };
    dispatched.OnReady(std::move(free));
  }
};

struct ClientCore::Lowering {
  int64_t id;                      // the program id hosts know this lowering by
  rpc::ProgramProto proto;
  std::vector<std::string> hosts;  // every host that runs, holds or sends anything in it
  std::vector<std::vector<std::string>> node_hosts;  // per node: its slice's and its inputs' hosts
  int64_t num_outputs = 0;
  std::vector<int64_t> output_offsets;              // per node
  std::vector<std::vector<Sharding>> out_shardings;  // per node and output
  absl::Mutex mu;
  absl::flat_hash_set<std::string> registered_on ABSL_GUARDED_BY(mu);
  std::atomic<bool> ready{false};  // compiled and registered on every host
};

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

std::string VirtualSlice::ToString() const {
  std::vector<std::string> devices;
  for (const auto& d : data_->devices) {
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

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& controller_address) {
  auto core = std::make_shared<ClientCore>(controller_address);
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
      absl::StrAppendFormat(&out, "    device %d  %s:%d  memory %d / %d bytes  ran %d\n",
                            d.device_id(), d.kind(), d.local_index(), d.memory_used(),
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
  request.set_client_id(core_->id());
  PW_ASSIGN_OR_RETURN(rpc::AllocateSliceResponse response, core_->controller().AllocateSlice(request));
  if (response.devices_size() != mesh.num_devices()) {
    return absl::InternalError(absl::StrCat("controller placed ", response.devices_size(),
                                            " devices for a mesh of ", mesh.num_devices()));
  }
  auto data = std::make_shared<VirtualSlice::Data>();
  data->id = response.slice_id();
  data->mesh = std::move(mesh);
  data->owner = core_.get();
  for (const auto& d : response.devices()) {
    data->devices.push_back(
        {d.device_id(), d.host_id(), d.host_address(), d.local_index(), d.island()});
    if (std::find(data->hosts.begin(), data->hosts.end(), d.host_address()) == data->hosts.end()) {
      data->hosts.push_back(d.host_address());
    }
  }
  VirtualSlice slice;
  slice.data_ = std::move(data);
  return slice;
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
    fn.compiled_on.insert(hosts[i]);
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
  auto state = std::make_shared<ShardedArray::State>(core_, core_->NextArrayId(), data.spec(), sharding, slice);
  const size_t element = DTypeSize(data.dtype());
  for (int64_t s = 0; s < slice.num_devices(); ++s) {
    const PhysicalDeviceInfo& dev = slice.devices()[s];
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
    core_->Push(dev.host_address, std::move(op));
  }
  ShardedArray array;
  array.state_ = std::move(state);
  return array;
}

namespace {

PartitionSpec OrReplicated(const std::vector<PartitionSpec>& specs, size_t i, const Shape& shape) {
  return specs.empty() ? PartitionSpec(shape.size(), "") : specs[i];
}

rpc::PartitionSpecProto ToProto(const PartitionSpec& spec, size_t rank) {
  rpc::PartitionSpecProto p;
  for (size_t d = 0; d < rank; ++d) p.add_dims(spec.empty() ? "" : spec[d]);
  return p;
}

void AddHosts(const VirtualSlice& slice, std::vector<std::string>& hosts) {
  for (const std::string& h : slice.host_addresses()) {
    if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<ClientCore::Lowering>> ClientCore::Lower(const Program& program,
                                                                        absl::Span<const ShardedArray> args) {
  std::string key = absl::StrCat(program.id());
  for (const ShardedArray& a : args) {
    absl::StrAppend(&key, "|", a.slice().id(), PartitionSpecToString(a.sharding().spec()));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = lowerings_cache_.find(key);
    if (it != lowerings_cache_.end()) return it->second;
  }
  auto lowering = std::make_shared<Lowering>();
  lowering->id = run_ids_.Next();
  rpc::ProgramProto& proto = lowering->proto;
  proto.set_program_id(lowering->id);
  proto.set_name(program.name());
  std::map<int64_t, VirtualSlice> slices;
  for (const ShardedArray& a : args) slices.emplace(a.slice().id(), a.slice());
  for (const Program::Call& c : program.calls()) {
    if (c.slice.data_->owner != this) {
      return absl::InvalidArgumentError(absl::StrCat("program '", program.name(), "' calls '", c.function.name(),
                                                     "' on a slice that this client did not create"));
    }
    if (c.function.state_->owner != this) {
      return absl::InvalidArgumentError(absl::StrCat("program '", program.name(), "' calls '", c.function.name(),
                                                     "', which this client did not compile"));
    }
    slices.emplace(c.slice.id(), c.slice);
  }
  for (const auto& [id, slice] : slices) {
    rpc::SliceProto* sp = proto.add_slices();
    sp->set_slice_id(id);
    for (int64_t d : slice.mesh().dims) sp->add_mesh_dims(d);
    for (const std::string& n : slice.mesh().axis_names) sp->add_axis_names(n);
    for (const PhysicalDeviceInfo& d : slice.devices()) {
      rpc::SliceDevice* sd = sp->add_devices();
      sd->set_device_id(d.device_id);
      sd->set_host_address(d.host_address);
      sd->set_local_index(d.local_index);
    }
    AddHosts(slice, lowering->hosts);
  }
  for (const ShardedArray& a : args) {
    rpc::ProgramArg* pa = proto.add_args();
    *pa->mutable_spec() = pathways::ToProto(a.spec());
    pa->set_slice_id(a.slice().id());
    *pa->mutable_sharding() = ToProto(a.sharding().spec(), a.spec().shape.size());
  }
  auto value_slice = [&](const Program::Value& v) -> const VirtualSlice& {
    return v.is_arg ? args[v.index].slice() : program.calls()[v.index].slice;
  };
  for (const Program::Call& c : program.calls()) {
    const FunctionSpec& spec = c.function.spec();
    const std::string& name = spec.body.name;
    rpc::ProgramNode* node = proto.add_nodes();
    node->set_function_key(c.function.state_->key);
    node->set_function_name(name);
    node->set_slice_id(c.slice.id());
    std::vector<std::string> hosts;
    AddHosts(c.slice, hosts);
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
      AddHosts(value_slice(c.inputs[i]), hosts);
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
    lowering->out_shardings.push_back(std::move(outs));
    lowering->output_offsets.push_back(lowering->num_outputs);
    lowering->num_outputs += static_cast<int64_t>(spec.outputs.size());
    lowering->node_hosts.push_back(std::move(hosts));
  }
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
  Promise<Unit> done;

  static void Next(std::shared_ptr<SegmentedDispatch> d, size_t k) {
    const Segment& seg = d->segments[k];
    {
      // Each op is one epoch of the program's dataflow. Hosts require a client's epochs to arrive
      // in increasing order, so numbering and pushing happen together.
      absl::MutexLock lock(&d->core->epoch_mu());
      const int64_t epoch = d->core->NextRunId();
      for (const std::string& host : seg.hosts) {
        rpc::Op op;
        *op.mutable_run() = d->op;
        op.mutable_run()->set_first_node(seg.first);
        op.mutable_run()->set_last_node(seg.last);
        op.mutable_run()->set_epoch(epoch);
        d->core->Push(host, std::move(op));
      }
    }
    if (k + 1 == d->segments.size()) {
      d->done.Set(Unit{});
      return;
    }
    std::vector<Future<Unit>> waits;
    if (seg.wait_until_computed) {
      for (const auto& out : d->node_outputs[seg.last]) waits.push_back(ShardsReady(d->core, out));
    } else {
      for (const std::string& host : seg.hosts) waits.push_back(d->core->queue(host)->Flushed());
    }
    JoinAll(waits).OnReady([d, k](const absl::StatusOr<std::vector<Unit>>& r) {
      if (!r.ok()) {
        d->done.Set(r.status());
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
    if (!arrays[i].state_ || arrays[i].state_->core.get() != core_.get()) {
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
  PW_ASSIGN_OR_RETURN(std::shared_ptr<ClientCore::Lowering> lowering, core_->Lower(program, args));

  // An argument still being dispatched by a sequential run: wait until its op is pushed, so
  // this run's ops follow it in every host's queue.
  for (const ShardedArray& a : args) {
    if (!a.state_->dispatched.IsReady()) PW_RETURN_IF_ERROR(a.state_->dispatched.Await().status());
  }
  // The first run of a lowering compiles what hosts that joined after Compile lack and registers
  // the program on every host; later runs skip straight to dispatch.
  if (!lowering->ready.load(std::memory_order_acquire)) {
    for (const Program::Call& c : program.calls()) {
      std::vector<std::string> missing;
      {
        absl::MutexLock lock(&c.function.state_->mu);
        for (const std::string& host : c.slice.host_addresses()) {
          if (!c.function.state_->compiled_on.contains(host)) missing.push_back(host);
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
          lowering->out_shardings[n][j], c.slice);
      state->dispatched = dispatched;
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

ClientStats Client::stats() const { return core_->stats(); }

absl::StatusOr<Program> ClientCore::OneNodeProgram(const CompiledFunction& function, const VirtualSlice& slice) {
  std::pair<const void*, int64_t> key{function.state_.get(), slice.id()};
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
  return Run(program, inputs);
}

namespace {

// Flushes the client's queue to `host`, then fetches the given shards from it.
Future<rpc::FetchResponse> FetchFromHost(ClientCore& core, const std::string& host,
                                         rpc::FetchRequest request) {
  std::shared_ptr<WorkerClient> worker = core.worker(host);
  return core.queue(host)->Flushed().FlatThen(
      [worker, request = std::move(request)](const Unit&) { return worker->Fetch(request); });
}

// The distinct shards of an array that a full read needs, fetched from their hosts.
Future<std::vector<rpc::FetchResponse>> FetchShards(const std::shared_ptr<ClientCore>& core,
                                                    const ShardedArray::State& state,
                                                    const std::vector<int64_t>& shards, bool status_only) {
  std::map<std::string, std::vector<int32_t>> by_host;
  for (int64_t s : shards) by_host[state.slice.devices()[s].host_address].push_back(static_cast<int32_t>(s));
  std::vector<Future<rpc::FetchResponse>> responses;
  for (auto& [host, host_shards] : by_host) {
    rpc::FetchRequest request;
    request.set_client_id(core->id());
    request.set_array_id(state.id);
    request.set_status_only(status_only);
    for (int32_t s : host_shards) request.add_shards(s);
    responses.push_back(FetchFromHost(*core, host, std::move(request)));
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

// Both wait until the array's producing op has been pushed (sequential runs push late).
Future<HostArray> Client::Fetch(const ShardedArray& array) {
  auto core = core_;
  auto state = array.state_;
  return state->dispatched
      .FlatThen([core, state](const Unit&) {
        return FetchShards(core, *state, DistinctShards(state->sharding), /*status_only=*/false);
      })
      .Then([state](const std::vector<rpc::FetchResponse>& all) { return Assemble(*state, all); });
}

Future<Unit> Client::Ready(const ShardedArray& array) {
  auto core = core_;
  auto state = array.state_;
  return state->dispatched.FlatThen([core, state](const Unit&) { return ShardsReady(core, state); });
}

}  // namespace pathways
