#include "client/client.h"

#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
  TransferKey NextTransferKey() { return transfer_keys_.Next(); }

 private:
  const std::string id_;
  ControllerClient controller_;
  IdGenerator array_ids_;
  IdGenerator transfer_keys_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<HostOpQueue>> queues_ ABSL_GUARDED_BY(mu_);
};

struct CompiledFunction::State {
  FunctionSpec spec;
  std::string key;
  const ClientCore* owner;
  absl::Mutex mu;
  absl::flat_hash_set<std::string> compiled_on ABSL_GUARDED_BY(mu);  // host addresses
};

struct ShardedArray::State {
  std::shared_ptr<ClientCore> core;
  ArrayId id;
  TensorSpec spec;
  Sharding sharding;
  VirtualSlice slice;

  // Freeing goes through each host's ordered queue, behind every op that still reads the array.
  ~State() {
    for (const std::string& host : slice.host_addresses()) {
      rpc::Op op;
      op.mutable_free()->set_array_id(id);
      core->queue(host)->Push(std::move(op));
    }
  }
};

namespace {

std::vector<int64_t> Sub(const Shape& a, const Shape& b) {
  std::vector<int64_t> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

void SetRegion(const Shape& start, const Shape& size, rpc::RegionProto* p) {
  for (int64_t s : start) p->add_start(s);
  for (int64_t s : size) p->add_size(s);
}

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

std::vector<std::string> VirtualSlice::host_addresses() const {
  std::vector<std::string> hosts;
  for (const auto& d : data_->devices) {
    if (std::find(hosts.begin(), hosts.end(), d.host_address) == hosts.end()) {
      hosts.push_back(d.host_address);
    }
  }
  return hosts;
}

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
  auto state = std::make_shared<ShardedArray::State>(
      ShardedArray::State{core_, core_->NextArrayId(), data.spec(), sharding, slice});
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
    core_->queue(dev.host_address)->Push(std::move(op));
  }
  ShardedArray array;
  array.state_ = std::move(state);
  return array;
}

absl::StatusOr<std::vector<ShardedArray>> Client::Call(const CompiledFunction& function,
                                                       const VirtualSlice& slice,
                                                       absl::Span<const ShardedArray> inputs) {
  if (!function.state_ || function.state_->owner != core_.get()) {
    return absl::InvalidArgumentError("Call of a function that this client did not compile");
  }
  if (!slice.data_ || slice.data_->owner != core_.get()) {
    return absl::InvalidArgumentError("Call on a slice that this client did not create");
  }
  const FunctionSpec& spec = function.spec();
  const std::string& name = spec.body.name;
  if (inputs.size() != spec.inputs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("function '", name, "' takes ", spec.inputs.size(),
                                                   " inputs, got ", inputs.size()));
  }
  std::vector<Sharding> in_shardings, out_shardings;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].state_ || inputs[i].state_->core.get() != core_.get()) {
      return absl::InvalidArgumentError(
          absl::StrCat("function '", name, "' input ", i, " is not an array of this client"));
    }
    if (inputs[i].spec() != spec.inputs[i]) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' input ", i, " must be ",
                                                     spec.inputs[i].ToString(), ", got ",
                                                     inputs[i].spec().ToString()));
    }
    auto s = Sharding::Create(slice.mesh(), spec.in_shardings.empty() ? PartitionSpec{} : spec.in_shardings[i],
                              spec.inputs[i].shape);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' input ", i, ": ", s.status().message()));
    }
    in_shardings.push_back(*std::move(s));
  }
  for (size_t j = 0; j < spec.outputs.size(); ++j) {
    auto s = Sharding::Create(slice.mesh(), spec.out_shardings.empty() ? PartitionSpec{} : spec.out_shardings[j],
                              spec.outputs[j].shape);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("function '", name, "' output ", j, ": ", s.status().message()));
    }
    out_shardings.push_back(*std::move(s));
  }

  // Hosts that joined after Compile get the body now.
  std::vector<std::string> missing;
  {
    absl::MutexLock lock(&function.state_->mu);
    for (const std::string& host : slice.host_addresses()) {
      if (!function.state_->compiled_on.contains(host)) missing.push_back(host);
    }
  }
  if (!missing.empty()) PW_RETURN_IF_ERROR(core_->CompileOn(*function.state_, missing));

  std::vector<ShardedArray> outputs;
  for (size_t j = 0; j < spec.outputs.size(); ++j) {
    ShardedArray out;
    out.state_ = std::make_shared<ShardedArray::State>(
        ShardedArray::State{core_, core_->NextArrayId(), spec.outputs[j], out_shardings[j], slice});
    outputs.push_back(std::move(out));
  }

  std::map<std::string, rpc::Op> per_host;  // one ExecuteOp per host, covering its shards
  for (int64_t d = 0; d < slice.num_devices(); ++d) {
    const PhysicalDeviceInfo& dev = slice.devices()[d];
    auto [it, inserted] = per_host.try_emplace(dev.host_address);
    rpc::ExecuteOp* op = it->second.mutable_execute();
    if (inserted) {
      op->set_function_key(function.state_->key);
      op->set_function_name(name);
      for (size_t j = 0; j < outputs.size(); ++j) {
        op->add_output_array_ids(outputs[j].id());
        *op->add_output_specs() = ToProto(TensorSpec{spec.outputs[j].dtype, out_shardings[j].local_shape()});
      }
    }
    rpc::ShardExecution* shard = op->add_shards();
    shard->set_shard(static_cast<int32_t>(d));
    shard->set_local_device(dev.local_index);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const ShardedArray::State& src = *inputs[i].state_;
      rpc::ShardInput* input = shard->add_inputs();
      *input->mutable_spec() = ToProto(TensorSpec{spec.inputs[i].dtype, in_shardings[i].local_shape()});
      const Region target = in_shardings[i].ShardRegion(d);
      // Each distinct source region that overlaps the target, read from its closest replica.
      struct Source {
        Region region;
        int64_t shard;
        int score;  // 2: same device, 1: same host, 0: another host
      };
      std::vector<Source> sources;
      for (int64_t s = 0; s < src.sharding.num_shards(); ++s) {
        Region r = src.sharding.ShardRegion(s);
        if (!Intersect(r, target).has_value()) continue;
        const PhysicalDeviceInfo& sdev = src.slice.devices()[s];
        int score = sdev.device_id == dev.device_id ? 2 : sdev.host_address == dev.host_address ? 1 : 0;
        auto same = std::find_if(sources.begin(), sources.end(),
                                 [&](const Source& x) { return x.region == r; });
        if (same == sources.end()) {
          sources.push_back({r, s, score});
        } else if (score > same->score) {
          *same = {r, s, score};
        }
      }
      for (const Source& source : sources) {
        Region overlap = *Intersect(source.region, target);
        Shape src_start = Sub(overlap.start, source.region.start);
        rpc::InputPiece* piece = input->add_pieces();
        for (int64_t v : Sub(overlap.start, target.start)) piece->add_dst_start(v);
        const std::string& src_host = src.slice.devices()[source.shard].host_address;
        if (src_host == dev.host_address) {
          piece->mutable_local()->set_array_id(src.id);
          piece->mutable_local()->set_shard(static_cast<int32_t>(source.shard));
          SetRegion(src_start, overlap.size, piece->mutable_src_region());
        } else {
          TransferKey key = core_->NextTransferKey();
          rpc::Op send;
          send.mutable_send()->mutable_source()->set_array_id(src.id);
          send.mutable_send()->mutable_source()->set_shard(static_cast<int32_t>(source.shard));
          SetRegion(src_start, overlap.size, send.mutable_send()->mutable_region());
          send.mutable_send()->set_dest_address(dev.host_address);
          send.mutable_send()->set_transfer_key(key);
          core_->queue(src_host)->Push(std::move(send));
          piece->set_transfer_key(key);
          SetRegion(Shape(overlap.size.size(), 0), overlap.size, piece->mutable_src_region());
        }
      }
    }
  }
  for (auto& [host, op] : per_host) core_->queue(host)->Push(std::move(op));
  return outputs;
}

namespace {

// Flushes the client's queue to `host`, then fetches the given shards from it.
Future<rpc::FetchResponse> FetchFromHost(ClientCore& core, const std::string& host,
                                         rpc::FetchRequest request) {
  Promise<rpc::FetchResponse> promise;
  Future<rpc::FetchResponse> result = promise.future();
  std::shared_ptr<WorkerClient> worker = core.worker(host);
  core.queue(host)->Flushed().OnReady(
      [worker, request = std::move(request), promise = std::move(promise)](
          const absl::StatusOr<Unit>& flushed) mutable {
        if (!flushed.ok()) {
          promise.Set(flushed.status());
          return;
        }
        worker->Fetch(request).OnReady(
            [promise = std::move(promise)](const absl::StatusOr<rpc::FetchResponse>& r) mutable {
              promise.Set(r);
            });
      });
  return result;
}

std::map<std::string, std::vector<int32_t>> ShardsByHost(const ShardedArray& array,
                                                         const std::vector<int64_t>& shards) {
  std::map<std::string, std::vector<int32_t>> by_host;
  for (int64_t s : shards) {
    by_host[array.slice().devices()[s].host_address].push_back(static_cast<int32_t>(s));
  }
  return by_host;
}

}  // namespace

Future<HostArray> Client::Fetch(const ShardedArray& array) {
  std::vector<Future<rpc::FetchResponse>> responses;
  for (auto& [host, shards] : ShardsByHost(array, DistinctShards(array.sharding()))) {
    rpc::FetchRequest request;
    request.set_client_id(core_->id());
    request.set_array_id(array.id());
    for (int32_t s : shards) request.add_shards(s);
    responses.push_back(FetchFromHost(*core_, host, std::move(request)));
  }
  // Holding the array's state keeps its shards alive until the fetch is done.
  auto state = array.state_;
  return JoinAll(responses).Then(
      [state](const std::vector<rpc::FetchResponse>& all) -> absl::StatusOr<HostArray> {
        PW_ASSIGN_OR_RETURN(HostArray out, HostArray::Create(state->spec.dtype, state->spec.shape));
        const Shape& local = state->sharding.local_shape();
        for (const rpc::FetchResponse& response : all) {
          for (const rpc::ShardData& shard : response.shards()) {
            if (shard.shard() < 0 || shard.shard() >= state->sharding.num_shards()) {
              return absl::InternalError(absl::StrCat("worker returned unknown shard ", shard.shard()));
            }
            PW_ASSIGN_OR_RETURN(TensorSpec got, FromProto(shard.spec()));
            if (got != TensorSpec{state->spec.dtype, local} ||
                static_cast<int64_t>(shard.data().size()) != *ByteSize(got.dtype, got.shape)) {
              return absl::InternalError(absl::StrCat("worker returned shard ", shard.shard(), " as ",
                                                      got.ToString(), ", expected ",
                                                      TensorSpec{state->spec.dtype, local}.ToString()));
            }
            Region region = state->sharding.ShardRegion(shard.shard());
            CopyRegion(shard.data().data(), local, Shape(local.size(), 0), local,
                       DTypeSize(got.dtype), out.mutable_bytes().data(), out.shape(), region.start);
          }
        }
        return out;
      });
}

Future<Unit> Client::Ready(const ShardedArray& array) {
  std::vector<int64_t> all(static_cast<size_t>(array.sharding().num_shards()));
  for (size_t s = 0; s < all.size(); ++s) all[s] = static_cast<int64_t>(s);
  std::vector<Future<rpc::FetchResponse>> responses;
  for (auto& [host, shards] : ShardsByHost(array, all)) {
    rpc::FetchRequest request;
    request.set_client_id(core_->id());
    request.set_array_id(array.id());
    request.set_status_only(true);
    for (int32_t s : shards) request.add_shards(s);
    responses.push_back(FetchFromHost(*core_, host, std::move(request)));
  }
  auto state = array.state_;
  return JoinAll(responses).Then([state](const std::vector<rpc::FetchResponse>&) { return Unit{}; });
}

}  // namespace pathways
