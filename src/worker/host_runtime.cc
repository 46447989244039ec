#include "worker/host_runtime.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "array/sharding.h"
#include "collective/tcp_links.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "device/cpu_device.h"
#include "dataflow/graph.h"
#include "transport/rpc_util.h"
#include "worker/input_assembly.h"

namespace pathways {
namespace {

// Links to other hosts when the host has somewhere to meet them; collectives stay within the
// host otherwise.
std::shared_ptr<collective::TcpLinks> LinksFor(const HostRuntimeOptions& options, DcnEmulation* dcn) {
  if (options.rendezvous == nullptr) return nullptr;
  std::string ip = options.name.substr(0, options.name.rfind(':'));
  if (ip.size() > 2 && ip.front() == '[' && ip.back() == ']') ip = ip.substr(1, ip.size() - 2);
  auto links = collective::TcpLinks::Create(options.name, ip, options.rendezvous, dcn, options.cluster_token);
  if (!links.ok()) {
    PW_LOG(Error) << "host " << options.name << " has no collectives across hosts: " << links.status();
    return nullptr;
  }
  return *std::move(links);
}

}  // namespace

HostRuntime::HostRuntime(HostRuntimeOptions options)
    : options_(std::move(options)),
      dcn_(options_.dcn.enabled() ? std::make_shared<DcnEmulation>(options_.island, options_.dcn) : nullptr),
      links_(LinksFor(options_, dcn_.get())),
      collectives_(options_.name, links_, options_.collective_timeout),
      io_pool_(options_.name + "-io", 2),
      dataflow_transport_(options_.name),
      dcn_transport_(dcn_ != nullptr ? std::make_unique<dataflow::DcnTransport>(dataflow_transport_, *dcn_) : nullptr),
      sequencer_([this](const std::string& client, const rpc::Op& op) { ApplyOp(client, op); },
                 [this](const std::string& client) { CollectClient(client); }, options_.sequence_gap_timeout),
      control_({options_.name, options_.dataflow_service, &dataflow_transport_, &io_pool_,
                [this](std::vector<rpc::ScheduledOp> ops) { return ApplyScheduled(std::move(ops)); }}) {
  ConfigureComputeThreads(options_.intra_op_threads);
  for (int i = 0; i < options_.num_devices; ++i) {
    devices_.push_back(std::make_unique<CpuDevice>(i, options_.device_memory_bytes, options_.name));
  }
  if (links_ != nullptr) {
    blocks_ = std::make_unique<collective::BlockStreams>(
        *links_, options_.name, dcn_.get(), options_.collective_timeout,
        [this](const std::string& from, const std::string& header, uint64_t bytes) {
          return LandBlock(from, header, bytes);
        });
  }
  JoinInProcessDirectory();
}

// Work moves between the I/O pool and the device streams in both directions, so both are
// stopped (draining what is queued) before either is destroyed; work that arrives later is
// dropped, which cancels its futures.
HostRuntime::~HostRuntime() {
  LeaveInProcessDirectory();
  control_.Shutdown();
  blocks_.reset();  // fails blocks still queued; nothing lands in the store after this
  if (options_.dataflow_service != nullptr) {
    absl::MutexLock lock(&programs_mu_);
    for (const auto& [key, program] : programs_) options_.dataflow_service->RemoveEngine(program->engine->graph().name());
  }
  io_pool_.Shutdown();
  BeginShutdown();  // work still queued on the devices ends quickly
  for (auto& d : devices_) d->Shutdown();
}

void HostRuntime::BeginShutdown() {
  const absl::Status going = absl::CancelledError(absl::StrCat("host ", name(), " is shutting down"));
  sequencer_.FailWaiters(going);
  collectives_.Shutdown();
  store_.FailAllTransfers(going);
}

void HostRuntime::PublishLinks() {
  if (links_ == nullptr) return;
  if (absl::Status s = links_->Publish(); !s.ok()) {
    PW_LOG(Warning) << "host " << name() << " could not publish its links (it tries again on first use): " << s;
  }
}

absl::StatusOr<std::string> HostRuntime::Compile(const rpc::FunctionBodyProto& proto) {
  if (proto.kind() != static_cast<int>(FunctionBody::Kind::kTorchScript) &&
      proto.kind() != static_cast<int>(FunctionBody::Kind::kBuiltin)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown function body kind ", proto.kind()));
  }
  FunctionBody body{static_cast<FunctionBody::Kind>(proto.kind()), proto.name(), proto.source()};
  PW_ASSIGN_OR_RETURN(auto exe, functions_.Compile(body));
  (void)exe;
  return FunctionKey(body);
}

absl::Status HostRuntime::ValidateOp(const rpc::Op& op) const {
  switch (op.kind_case()) {
    case rpc::Op::kRegisterProgram:
    case rpc::Op::kRun:
    case rpc::Op::kFree:
      return absl::OkStatus();  // checked against the registered programs when applied
    case rpc::Op::kSkip:
      return absl::OkStatus();
    case rpc::Op::kPut:
      if (op.put().local_device() < 0 || op.put().local_device() >= num_devices()) {
        return absl::InvalidArgumentError(absl::StrCat("device ", op.put().local_device(), " does not exist on ",
                                                       name(), " (", num_devices(), " devices)"));
      }
      return FromProto(op.put().spec()).status();
    default:
      return absl::InvalidArgumentError("op of unknown kind");
  }
}

absl::Status HostRuntime::Enqueue(const rpc::EnqueueRequest& request) {
  if (request.client_id().empty()) return absl::InvalidArgumentError("request has no client id");
  absl::Status status;
  std::vector<rpc::Op> ops(request.ops().begin(), request.ops().end());
  for (size_t i = 0; i < ops.size(); ++i) {
    absl::Status s = ValidateOp(ops[i]);
    if (s.ok()) continue;
    if (status.ok()) status = absl::Status(s.code(), absl::StrCat("op ", i, ": ", s.message()));
    ops[i].mutable_skip();  // keeps its place in the sequence, does nothing
  }
  absl::Duration delay;
  if (test_op_delays_set_.load(std::memory_order_relaxed)) {
    absl::MutexLock lock(&programs_mu_);
    auto it = test_op_delays_.find(request.client_id());
    if (it != test_op_delays_.end()) delay = it->second;
  }
  if (delay > absl::ZeroDuration()) {
    io_pool_.Schedule([this, client = request.client_id(), ops = std::move(ops), delay]() mutable {
      absl::SleepFor(delay);
      (void)sequencer_.AddDirect(client, std::move(ops));
    });
    return status;
  }
  absl::Status sequenced = sequencer_.AddDirect(request.client_id(), std::move(ops));
  return status.ok() ? sequenced : status;
}

absl::Status HostRuntime::ApplyScheduled(std::vector<rpc::ScheduledOp> ops) {
  for (const rpc::ScheduledOp& op : ops) {
    if (op.client_id().empty() || (!op.op().has_run() && !op.retire_client())) {
      return absl::InvalidArgumentError("a scheduled op must be a run or a retirement, with a client id");
    }
  }
  return sequencer_.AddScheduled(std::move(ops));
}

bool HostRuntime::CollectClient(const std::string& client) {
  std::vector<std::shared_ptr<Program>> programs;
  {
    absl::MutexLock lock(&programs_mu_);
    if (!collected_.insert(client).second) return false;
    for (auto it = programs_.begin(); it != programs_.end();) {
      if (it->first.first == client) {
        programs.push_back(std::move(it->second));
        programs_.erase(it++);
      } else {
        ++it;
      }
    }
    last_epoch_.erase(client);
    failed_registrations_.erase(client);
  }
  const absl::Status gone = absl::CancelledError(absl::StrCat("client ", client, " went away"));
  for (const auto& p : programs) options_.dataflow_service->RemoveEngine(p->engine->graph().name());
  const int dropped = store_.DropClient(client, gone);
  PW_LOG(Info) << "host " << name() << " collected client " << client << ": " << dropped << " shards, "
               << programs.size() << " programs";
  return true;
}

// Runs under the sequencer's lock, one op at a time.
void HostRuntime::ApplyOp(const std::string& client, const rpc::Op& op) {
  absl::Status s;
  switch (op.kind_case()) {
    case rpc::Op::kRegisterProgram:
      s = RegisterProgram(client, op.register_program().program());
      if (!s.ok()) {
        absl::MutexLock lock(&programs_mu_);
        auto& failed = failed_registrations_[client];
        if (failed.size() >= ObjectStore::kFailedRangesPerClient) failed.erase(failed.begin());
        failed[op.register_program().program().program_id()] = s;
      }
      break;
    case rpc::Op::kRun:
      s = RunProgram(client, op.run());
      // Nothing of the run was set up here: what it was to make fails with the reason.
      if (!s.ok()) {
        store_.FailArrays(client, op.run().output_array_base(),
                          std::clamp<int64_t>(op.run().num_output_arrays(), 0, int64_t{1} << 20), s);
      }
      break;
    case rpc::Op::kPut: Put(client, op.put()); break;
    case rpc::Op::kFree: store_.FreeArray(client, op.free().array_id()); break;
    case rpc::Op::kSkip: break;
    default: s = absl::InternalError("op of unknown kind was applied"); break;  // ValidateOp refuses these
  }
  // Also in the failures of what the op was to make (above), for whoever reads them.
  if (!s.ok()) PW_LOG(Warning) << "host " << name() << ", client " << client << ", op " << op.seq() << ": " << s;
}

absl::Status HostRuntime::RegisterProgram(const std::string& client, const rpc::ProgramProto& proto) {
  if (options_.dataflow_service == nullptr) return absl::FailedPreconditionError("host has no dataflow service");
  auto program = std::make_shared<Program>();
  PW_ASSIGN_OR_RETURN(program->lowered, LoweredProgram::Create(proto, name(), num_devices()));
  program->client = client;
  if (dcn_ != nullptr) {
    for (const rpc::SliceProto& slice : proto.slices()) {
      for (const rpc::SliceDevice& d : slice.devices()) dcn_->NoteHost(d.host_address(), d.island());
    }
  }
  const LoweredProgram& lowered = *program->lowered;
  // Every host derives the same graph: the same plans over the same hosts in the same order.
  auto graph = std::make_shared<dataflow::GraphDef>(absl::StrCat(client, "/", proto.program_id()));
  std::map<const LoweredSlice*, std::shared_ptr<const collective::GangLayout>> gangs;  // one per slice
  for (int n = 0; n < static_cast<int>(lowered.nodes().size()); ++n) {
    const LoweredNode& node = lowered.nodes()[n];
    NodePlan plan;
    std::shared_ptr<const collective::GangLayout>& gang = gangs[node.slice];
    if (gang == nullptr) {
      auto layout = std::make_shared<collective::GangLayout>();
      layout->mesh_dims = node.slice->mesh.dims;
      layout->axis_names = node.slice->mesh.axis_names;
      for (const DeviceLocation& d : node.slice->devices) layout->members.push_back({d.host, d.device_id});
      gang = std::move(layout);
    }
    plan.gang = gang;
    for (size_t j = 0; j < node.output_specs.size(); ++j) {
      plan.out_specs.push_back({node.output_specs[j].dtype, node.out_shardings[j].local_shape()});
    }
    for (int64_t shard : node.slice->local_shards) {
      plan.shards.push_back({shard, std::vector<std::vector<Piece>>(node.inputs.size())});
    }
    std::set<std::string> senders, receivers;
    for (size_t i = 0; i < node.inputs.size(); ++i) {
      Placement src = lowered.PlacementOf(node.inputs[i]);
      Placement dst{&node.in_shardings[i], &node.slice->devices};
      size_t local = 0;  // index into plan.shards, which follows local_shards' order
      for (int64_t d = 0; d < static_cast<int64_t>(node.slice->devices.size()); ++d) {
        const std::string& dest = node.slice->devices[d].host;
        std::vector<Piece> pieces = PlanShard(src, dst, d);
        for (const Piece& p : pieces) {
          const std::string& from = (*src.devices)[p.src_shard].host;
          if (from == dest) continue;
          senders.insert(from);
          receivers.insert(dest);
          if (from == name()) {
            plan.sends.push_back({static_cast<int>(i), p.src_shard, p.src_region, dest, static_cast<int32_t>(d)});
          }
        }
        if (dest == name()) plan.shards[local++].inputs[i] = std::move(pieces);
      }
    }
    if (!senders.empty()) {
      std::vector<std::string> send_hosts(senders.begin(), senders.end());
      std::vector<std::string> recv_hosts(receivers.begin(), receivers.end());
      for (int i = 0; i < static_cast<int>(send_hosts.size()); ++i) plan.sender_index[send_hosts[i]] = i;
      for (int i = 0; i < static_cast<int>(recv_hosts.size()); ++i) plan.receiver_index[recv_hosts[i]] = i;
      plan.send_node = *graph->AddNode(absl::StrCat("send", n), std::move(send_hosts));
      plan.arm_node = *graph->AddNode(absl::StrCat("arm", n), recv_hosts);
      plan.recv_node = *graph->AddNode(absl::StrCat("recv", n), std::move(recv_hosts));
      plan.edge = *graph->AddEdge(plan.send_node, plan.recv_node, dataflow::EdgeKind::kSparse);
      (void)*graph->AddEdge(plan.arm_node, plan.recv_node, dataflow::EdgeKind::kOneToOne);
    }
    program->nodes.push_back(std::move(plan));
  }
  // Graph node -> its operator: a sender (with its edge), an arming source, or a receiver (with
  // the program node whose blocks it takes).
  enum class Role { kSend, kArm, kReceive };
  std::map<int, std::pair<Role, int>> roles;
  for (int n = 0; n < static_cast<int>(program->nodes.size()); ++n) {
    const NodePlan& e = program->nodes[n];
    if (e.send_node < 0) continue;
    roles[e.send_node] = {Role::kSend, e.edge};
    roles[e.arm_node] = {Role::kArm, 0};
    roles[e.recv_node] = {Role::kReceive, n};
  }
  program->engine = std::make_shared<dataflow::Engine>(
      name(), std::move(graph),
      [this, client, roles](int node, int) -> std::unique_ptr<dataflow::Operator> {
        auto [role, value] = roles.at(node);
        switch (role) {
          case Role::kSend: return MakeBlockSender(value);
          case Role::kArm: return MakeArmingSource();
          case Role::kReceive: break;
        }
        return MakeBlockReceiver(client, value);
      },
      dcn_transport_ != nullptr ? static_cast<dataflow::Transport&>(*dcn_transport_) : dataflow_transport_, io_pool_);
  absl::MutexLock lock(&programs_mu_);
  auto& slot = programs_[{client, proto.program_id()}];
  if (slot != nullptr) return absl::AlreadyExistsError(absl::StrCat("program ", proto.program_id(), " is already registered"));
  options_.dataflow_service->AddEngine(program->engine.get());
  slot = std::move(program);
  return absl::OkStatus();
}

absl::Status HostRuntime::RunProgram(const std::string& client, const rpc::RunProgramOp& run) {
  if (int64_t delay = test_run_delay_us_.load(); delay > 0) absl::SleepFor(absl::Microseconds(delay));
  std::shared_ptr<Program> entry;
  {
    absl::MutexLock lock(&programs_mu_);
    int64_t& last = last_epoch_[client];
    if (run.epoch() <= last) {
      return absl::InvalidArgumentError(absl::StrCat("run epoch ", run.epoch(), " is not after epoch ", last));
    }
    last = run.epoch();
    auto it = programs_.find({client, run.program_id()});
    if (it != programs_.end()) entry = it->second;
  }
  if (entry == nullptr) {
    absl::MutexLock lock(&programs_mu_);
    if (auto c = failed_registrations_.find(client); c != failed_registrations_.end()) {
      if (auto it = c->second.find(run.program_id()); it != c->second.end()) {
        return absl::Status(it->second.code(), absl::StrCat("program ", run.program_id(), " failed to register on ",
                                                            name(), ": ", it->second.message()));
      }
    }
    return absl::NotFoundError(absl::StrCat("program ", run.program_id(), " is not registered on ", name()));
  }
  const LoweredProgram* program = entry->lowered.get();
  if (run.arg_array_ids_size() != static_cast<int>(program->args().size())) {
    return absl::InvalidArgumentError(absl::StrCat("program '", program->name(), "' takes ", program->args().size(),
                                                   " arguments, run gave ", run.arg_array_ids_size()));
  }
  const int num_nodes = static_cast<int>(program->nodes().size());
  if (run.first_node() < 0 || run.last_node() >= num_nodes || run.first_node() > run.last_node()) {
    return absl::InvalidArgumentError(absl::StrCat("nodes ", run.first_node(), "..", run.last_node(),
                                                   " are not in program '", program->name(), "' of ", num_nodes, " nodes"));
  }
  std::shared_ptr<RunTracker> tracker;
  if (run.report_done()) {
    int shards = 0;
    for (int n = run.first_node(); n <= run.last_node(); ++n) shards += static_cast<int>(entry->nodes[n].shards.size());
    rpc::RunDone done;
    done.set_client_id(client);
    done.set_epoch(run.epoch());
    // Reports leave from the I/O pool: this may be a scheduled op being applied, under the
    // control graph's lock.
    auto report = [this](rpc::RunDone d) {
      io_pool_.Schedule([this, d = std::move(d)]() mutable { control_.ReportDone(std::move(d)); });
    };
    if (shards == 0) {
      report(std::move(done));
    } else {
      tracker = std::make_shared<RunTracker>(shards, std::move(done), std::move(report));
    }
  }
  // Parallel dispatch within the range: every node's outputs, input wiring and sends are set up
  // now, before any of them has run.
  for (int n = run.first_node(); n <= run.last_node(); ++n) {
    std::vector<Future<Unit>> sends = SendInputs(entry, n, run);
    const NodePlan& plan = entry->nodes[n];
    for (const ShardPlan& shard : plan.shards) ExecuteShard(entry, n, shard, run, tracker);
    if (auto receiver = plan.receiver_index.find(name()); receiver != plan.receiver_index.end()) {
      (void)entry->engine->CloseInput(plan.arm_node, receiver->second, run.epoch());  // expecting all blocks now
    }
    auto sender = plan.sender_index.find(name());
    if (sender == plan.sender_index.end()) continue;
    // This host's part of the node's exchange ends once every block it owes is handed over.
    AllDone(sends).OnReady([entry, node = plan.send_node, shard = sender->second,
                            epoch = run.epoch()](const absl::StatusOr<Unit>&) {
      (void)entry->engine->CloseInput(node, shard, epoch);
    });
  }
  // Intermediates whose last consumer is now set up leave the store; their consumers and sends
  // hold their own references until they are done with them.
  for (int n = run.first_node(); n <= run.last_node(); ++n) {
    for (int64_t offset : program->dropped_after(n)) store_.FreeArray(client, run.output_array_base() + offset);
  }
  return absl::OkStatus();
}

void HostRuntime::FinishEpoch(const std::string& client, int64_t epoch, int node) {
  int failed = store_.FailUndeliveredTransfers(
      client, epoch, node, node,
      absl::InternalError(absl::StrCat("epoch ", epoch, ": a block of node ", node,
                                       " that every sender has accounted for never reached ", name())));
  if (failed > 0) PW_LOG(Error) << failed << " blocks of epoch " << epoch << " never reached " << name();
}

namespace {

ArrayId ValueArrayId(const LoweredProgram& program, const LoweredValue& v, const rpc::RunProgramOp& run) {
  if (v.is_arg) return run.arg_array_ids(v.index);
  return run.output_array_base() + program.nodes()[v.index].output_offset + v.output;
}

}  // namespace

std::vector<Future<Unit>> HostRuntime::SendInputs(const std::shared_ptr<Program>& entry, int node_index,
                                                   const rpc::RunProgramOp& run) {
  const LoweredNode& node = entry->lowered->nodes()[node_index];
  std::vector<Future<Unit>> sends;
  for (const PlannedSend& p : entry->nodes[node_index].sends) {
    const ArrayId array = ValueArrayId(*entry->lowered, node.inputs[p.input], run);
    sends.push_back(Send(entry, {array, static_cast<int32_t>(p.src_shard)}, p.region, p.dest,
                         {run.epoch(), node_index, p.input, p.dst_shard, p.src_shard}));
  }
  return sends;
}

// Counts a run's shards on this host down to done, adding up their device time, and reports.
struct HostRuntime::RunTracker {
  RunTracker(int shards, rpc::RunDone done, std::function<void(rpc::RunDone)> report)
      : left(shards), shards(shards), done(std::move(done)), report(std::move(report)) {}
  void ShardDone(int64_t device_us) {
    const int64_t total = device_us_.fetch_add(device_us) + device_us;
    if (left.fetch_sub(1) != 1) return;
    done.set_device_us(total / shards);
    report(std::move(done));
  }
  std::atomic<int> left;
  const int shards;
  std::atomic<int64_t> device_us_{0};
  rpc::RunDone done;
  std::function<void(rpc::RunDone)> report;
};

void HostRuntime::ExecuteShard(const std::shared_ptr<const Program>& entry, int node_index,
                               const ShardPlan& shard_plan, const rpc::RunProgramOp& run,
                               std::shared_ptr<RunTracker> tracker) {
  const LoweredProgram& program = *entry->lowered;
  const std::string& client = entry->client;
  const LoweredNode& node = program.nodes()[node_index];
  const int64_t shard = shard_plan.shard;
  const int32_t shard32 = static_cast<int32_t>(shard);
  // Output entries exist from now on, so later nodes and runs can consume them before they are
  // computed.
  auto outputs = std::make_shared<std::vector<Promise<BufferPtr>>>(node.output_specs.size());
  for (size_t j = 0; j < node.output_specs.size(); ++j) {
    store_.Put(client, {run.output_array_base() + node.output_offset + static_cast<int64_t>(j), shard32},
               (*outputs)[j].future());
  }
  auto fail = [outputs](const absl::Status& s) {
    for (auto& p : *outputs) p.Set(s);
  };
  std::shared_ptr<const Executable> exe = functions_.Lookup(node.function_key);
  if (exe == nullptr) {
    fail(absl::NotFoundError(absl::StrCat("function '", node.function_name, "' is not compiled on host ", name())));
    if (tracker) tracker->ShardDone(0);
    return;
  }
  auto plans = std::make_shared<std::vector<InputPlan>>();
  std::vector<Future<BufferPtr>> piece_futures;
  for (size_t i = 0; i < node.inputs.size(); ++i) {
    Placement src = program.PlacementOf(node.inputs[i]);
    const ArrayId array = ValueArrayId(program, node.inputs[i], run);
    InputPlan plan;
    plan.spec = {node.input_specs[i].dtype, node.in_shardings[i].local_shape()};
    plan.first_piece = piece_futures.size();
    for (const Piece& p : shard_plan.inputs[i]) {
      if ((*src.devices)[p.src_shard].host == name()) {
        piece_futures.push_back(store_.Get(client, {array, static_cast<int32_t>(p.src_shard)}));
        plan.src_regions.push_back(p.src_region);
      } else {
        piece_futures.push_back(store_.ExpectTransfer(
            client, {run.epoch(), node_index, static_cast<int32_t>(i), shard32, p.src_shard},
            (*src.devices)[p.src_shard].host));
        plan.src_regions.push_back({Shape(p.src_region.size.size(), 0), p.src_region.size});
      }
      plan.dst_starts.push_back(p.dst_start);
    }
    plans->push_back(std::move(plan));
  }
  Device* device = devices_[node.slice->local_devices[shard]].get();
  WorkLabel label{client, program.id(), run.run_id(), node_index, shard, node.function_name};
  collective::CollectiveHub* hub = &collectives_;
  // Enqueued now, in the order runs are applied here; the device waits for the inputs when it
  // reaches the item (an in-order stream, like an accelerator's).
  Future<std::vector<BufferPtr>> inputs = JoinAll(piece_futures);
  // The closure holds the program, and so the node's plan, until the work is done (the client
  // may be collected meanwhile).
  device->Enqueue([device, exe, plans, outputs, entry, node_index, shard, fail, label, hub,
                   memory_wait = options_.memory_wait, inputs = std::move(inputs), tracker = std::move(tracker)]() {
    const NodePlan& node_plan = entry->nodes[node_index];
    const std::string& function_name = label.name;
    // Work of a client that went away still runs once it is on the device: every host of the
    // island stopped that client at the same point of the island's order, so its gangs run
    // everywhere or nowhere. What it produces is freed as soon as it is done.
    const absl::StatusOr<std::vector<BufferPtr>>& pieces = inputs.Await();
    if (!pieces.ok()) {
      fail(absl::Status(pieces.status().code(), absl::StrCat("input of '", function_name, "' (shard ", shard,
                                                             "): ", pieces.status().message())));
      if (tracker) tracker->ShardDone(0);
      return;
    }
    auto run = [&]() -> absl::StatusOr<std::vector<BufferPtr>> {
      std::vector<BufferPtr> inputs;
      for (size_t i = 0; i < plans->size(); ++i) {
        auto in = AssembleInput(*device, memory_wait, (*plans)[i], *pieces);
        if (!in.ok()) {
          return absl::Status(in.status().code(), absl::StrCat("function '", function_name, "' input ", i,
                                                               " (shard ", shard, "): ", in.status().message()));
        }
        inputs.push_back(*std::move(in));
      }
      std::vector<BufferPtr> results;
      for (const TensorSpec& spec : node_plan.out_specs) {
        PW_ASSIGN_OR_RETURN(BufferPtr out, device->Allocate(spec.dtype, spec.shape, memory_wait));
        results.push_back(std::move(out));
      }
      std::vector<const DeviceBuffer*> in_ptrs;
      for (auto& b : inputs) in_ptrs.push_back(b.get());
      std::vector<DeviceBuffer*> out_ptrs;
      for (auto& b : results) out_ptrs.push_back(b.get());
      // The body's collectives meet the node's other shards of this run.
      collective::ShardCollectives collectives(*hub, node_plan.gang, {&label.client, label.program, label.run, label.node},
                                               shard);
      collective::ScopedShardCollectives scope(&collectives);
      PW_RETURN_IF_ERROR(exe->Run(in_ptrs, out_ptrs));
      return results;
    };
    const int64_t start_us = absl::ToUnixMicros(absl::Now());
    auto results = run();
    const int64_t end_us = absl::ToUnixMicros(absl::Now());
    device->RecordTrace({label, start_us, end_us});  // before results show
    if (tracker) tracker->ShardDone(end_us - start_us);
    if (!results.ok()) {
      fail(results.status());
      return;
    }
    for (size_t j = 0; j < results->size(); ++j) (*outputs)[j].Set((*results)[j]);
  });
}

}  // namespace pathways
