// Running a registered program on a host: each run op sets up every node's outputs, input wiring
// and sends at once (parallel asynchronous dispatch), then enqueues each local shard on its device.
#include <cstring>
#include <limits>

#include "absl/cleanup/cleanup.h"
#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "array/sharding.h"
#include "compute/stop_request.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "dataflow/graph.h"
#include "device/host_memory.h"
#include "transport/rpc_util.h"
#include "worker/host_runtime.h"
#include "worker/input_assembly.h"

namespace pathways {

absl::Status HostRuntime::RunProgram(const std::string& client, const rpc::RunProgramOp& run) {
  if (int64_t delay = test_run_delay_us_.load(); delay > 0) absl::SleepFor(absl::Microseconds(delay));
  std::shared_ptr<HostProgram> entry;
  {
    absl::MutexLock lock(&programs_mu_);
    Epoch& last = last_epoch_[client];
    if (Epoch(run.epoch()) <= last) {
      return absl::InvalidArgumentError(absl::StrCat("run epoch ", run.epoch(), " is not after epoch ", last.value()));
    }
    last = Epoch(run.epoch());
    auto it = programs_.find({client, LoweredProgramId(run.program_id())});
    if (it != programs_.end()) entry = it->second;
  }
  if (entry == nullptr) {
    absl::Status missing =
        absl::NotFoundError(absl::StrCat("program ", run.program_id(), " is not registered on ", name()));
    {
      absl::MutexLock lock(&programs_mu_);
      if (auto c = failed_registrations_.find(client); c != failed_registrations_.end()) {
        if (auto it = c->second.find(run.program_id()); it != c->second.end()) {
          missing =
              absl::Status(it->second.code(), absl::StrCat("program ", run.program_id(), " failed to register on ",
                                                           name(), ": ", it->second.message()));
        }
      }
    }
    // No segment of the run can have been set up here: its other hosts' members, in its
    // collectives, are told this host will not come, and their messages are dropped here.
    collectives_.RunNotStarted(client, run.program_id(), run.run_id(), missing);
    return missing;
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
  // Output ids are the base plus offsets below the program's output count: ids from a client
  // must not pass the largest id.
  const LoweredNode& last = program->nodes().back();
  const int64_t num_outputs = last.output_offset + static_cast<int64_t>(last.output_specs.size());
  if (run.output_array_base() < 0 || run.output_array_base() > std::numeric_limits<int64_t>::max() - num_outputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("run's output array base ", run.output_array_base(), " leaves no room for ", num_outputs, " ids"));
  }
  // Every run has a tracker while its shards here are not all done (runs_in_flight_); it
  // reports to the island scheduler when the run asks for it.
  int shards = 0;
  for (int n = run.first_node(); n <= run.last_node(); ++n) shards += static_cast<int>(entry->nodes[n].shards.size());
  rpc::RunDone done;
  std::function<void(rpc::RunDone)> report;
  if (run.report_done()) {
    done.set_client_id(client);
    done.set_epoch(run.epoch());
    // Reports leave from the I/O pool: this may be a scheduled op being applied, under the
    // control graph's lock.
    report = [this](rpc::RunDone d) {
      io_pool_.Schedule([this, d = std::move(d)]() mutable { control_.ReportDone(std::move(d)); });
    };
    if (shards == 0) report(std::move(done));
  }
  auto tracker = std::make_shared<RunTracker>(shards, std::move(done), std::move(report), runs_in_flight_);
  // Parallel dispatch within the range: every node's outputs, input wiring and sends are set up
  // now, before any of them has run.
  // Only a run with a node that takes donated buffers needs the gate (see ExecuteShard).
  Promise<Unit> donations_dropped;
  bool takes_donations = false;
  for (int n = run.first_node(); n <= run.last_node(); ++n) takes_donations |= !program->nodes()[n].output_donors.empty();
  const Future<Unit> gate = takes_donations ? donations_dropped.future() : Future<Unit>();
  for (int n = run.first_node(); n <= run.last_node(); ++n) {
    std::vector<Future<Unit>> sends = SendInputs(entry, n, run);
    const NodePlan& plan = entry->nodes[n];
    for (const ShardPlan& shard : plan.shards) ExecuteShard(entry, n, shard, run, tracker, gate);
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
  if (entry->lost.Has(run.epoch())) {
    // Batches of this run's block exchanges were dropped here before the program was set up:
    // what they carried never comes, and the exchanges' epochs never end.
    store_.FailTransfersForGood(
        client, Epoch(run.epoch()), run.first_node(), run.last_node(),
        absl::UnavailableError(absl::StrCat("run ", run.epoch(), " of program '", program->name(), "' on ", name(),
                                            ": dataflow batches for it were lost: ", entry->lost.why)));
  }
  // Intermediates whose last consumer is now set up leave the store; their consumers and sends
  // hold their own references until they are done with them.
  // So do arguments given to a node at a donated position: nothing but that node reads them from
  // now on, and once no earlier reader holds them either, the node takes their buffers.
  for (int n = run.first_node(); n <= run.last_node(); ++n) {
    for (int64_t offset : program->dropped_after(n)) store_.FreeArray(client, ArrayId(run.output_array_base()) + offset);
    for (int arg : program->args_donated_to(n)) store_.FreeArray(client, ArrayId(run.arg_array_ids(arg)));
  }
  if (takes_donations) donations_dropped.Set(Unit{});
  return absl::OkStatus();
}

void HostRuntime::FinishEpoch(const std::string& client, Epoch epoch, int node, const std::string& why) {
  int failed = store_.FailUndeliveredTransfers(
      client, epoch, node, node,
      absl::InternalError(absl::StrCat("epoch ", epoch.value(), ": a block of node ", node,
                                       " that every sender has accounted for never reached ", name(),
                                       why.empty() ? "" : ": ", why)));
  if (failed > 0) PW_LOG(Error) << failed << " blocks of epoch " << epoch << " never reached " << name();
}

namespace {

ArrayId ValueArrayId(const LoweredProgram& program, const LoweredValue& v, const rpc::RunProgramOp& run) {
  if (v.is_arg) return ArrayId(run.arg_array_ids(v.index));
  return ArrayId(run.output_array_base()) + program.nodes()[v.index].output_offset + v.output;
}

}  // namespace

std::vector<Future<Unit>> HostRuntime::SendInputs(const std::shared_ptr<HostProgram>& entry, int node_index,
                                                   const rpc::RunProgramOp& run) {
  const LoweredNode& node = entry->lowered->nodes()[node_index];
  std::vector<Future<Unit>> sends;
  for (const PlannedSend& p : entry->nodes[node_index].sends) {
    const ArrayId array = ValueArrayId(*entry->lowered, node.inputs[p.input], run);
    sends.push_back(Send(entry, {array, static_cast<int32_t>(p.src_shard)}, p.region, p.dest,
                         {Epoch(run.epoch()), node_index, p.input, p.dst_shard, p.src_shard}));
  }
  return sends;
}

// Counts a run's shards on this host down to done, adding up their device time, and reports
// when the run asked for it. The run is in flight here while the tracker lives: the shards' work
// holds it, so a shard whose work is dropped unrun counts as done too.
struct HostRuntime::RunTracker {
  RunTracker(int shards, rpc::RunDone done, std::function<void(rpc::RunDone)> report, std::atomic<int64_t>& in_flight)
      : left(shards), shards(shards), done(std::move(done)), report(std::move(report)), in_flight(in_flight) {
    in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  ~RunTracker() { in_flight.fetch_sub(1, std::memory_order_relaxed); }
  void ShardDone(int64_t device_us) {
    const int64_t total = device_us_.fetch_add(device_us) + device_us;
    if (left.fetch_sub(1) != 1 || !report) return;
    done.set_device_us(total / shards);
    report(std::move(done));
  }
  std::atomic<int> left;
  const int shards;
  std::atomic<int64_t> device_us_{0};
  rpc::RunDone done;
  std::function<void(rpc::RunDone)> report;  // empty: the run reports nothing
  std::atomic<int64_t>& in_flight;
};

namespace {

// The buffer for an output that takes donated input `input`: the input's own when nothing but this
// shard's work holds it (`held` references), so the body updates it in place; otherwise (an
// earlier run or a fetch still reads it) a copy, so that they see it unchanged.
absl::StatusOr<BufferPtr> DonatedBuffer(Device& device, absl::Duration memory_wait, const BufferPtr& input, long held) {
  if (input.use_count() <= held && input->device_index() == device.local_index()) {
    input->set_attachment(nullptr);  // what it carried (kept residuals) belongs to its old contents
    return input;
  }
  PW_ASSIGN_OR_RETURN(BufferPtr copy, device.Allocate(input->dtype(), input->shape(), memory_wait));
  std::memcpy(copy->data(), input->data(), static_cast<size_t>(input->byte_size()));
  return copy;
}

// How the failure of a node whose input failed begins.
constexpr absl::string_view kInputOf = "input of '";

// Shard `label.shard` of a gang failed (`why`) before or in its body, after `calls` collective
// calls: it makes no more, and its group mates are told, instead of waiting for it (and holding
// their devices) until the collective timeout.
void Withdraw(collective::CollectiveHub& hub, const NodePlan& plan, const WorkLabel& label, int calls,
              const absl::Status& why) {
  if (plan.gang == nullptr || plan.gang->members.size() <= 1) return;
  hub.Withdraw(plan.gang,
               collective::ShardCollectives::ExecutionKey({&label.client, label.program, label.run, label.node}),
               label.shard, calls, why);
}

}  // namespace

void HostRuntime::ExecuteShard(const std::shared_ptr<const HostProgram>& entry, int node_index,
                               const ShardPlan& shard_plan, const rpc::RunProgramOp& run,
                               std::shared_ptr<RunTracker> tracker, Future<Unit> donations_dropped) {
  const LoweredProgram& program = *entry->lowered;
  const std::string& client = entry->client;
  const LoweredNode& node = program.nodes()[node_index];
  const int64_t shard = shard_plan.shard;
  const int32_t shard32 = static_cast<int32_t>(shard);
  // Output entries exist from now on, so later nodes and runs can consume them before they are
  // computed.
  auto outputs = std::make_shared<std::vector<Promise<BufferPtr>>>(node.output_specs.size());
  for (size_t j = 0; j < node.output_specs.size(); ++j) {
    store_.Put(client, {ArrayId(run.output_array_base()) + node.output_offset + static_cast<int64_t>(j), shard32},
               (*outputs)[j].future());
  }
  auto fail = [this, outputs, entry](const absl::Status& s) {
    CountShardFailure(entry->client);
    for (auto& p : *outputs) p.Set(s);
  };
  std::shared_ptr<const Executable> exe = functions_.Lookup(node.function_key);
  WorkLabel label{client, program.id(), run.run_id(), node_index, shard, node.function_name};
  if (exe == nullptr) {
    const absl::Status missing =
        absl::NotFoundError(absl::StrCat("function '", node.function_name, "' is not compiled on host ", name()));
    Withdraw(collectives_, entry->nodes[node_index], label, 0, missing);
    fail(missing);
    tracker->ShardDone(0);
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
            client, {Epoch(run.epoch()), node_index, static_cast<int32_t>(i), shard32, p.src_shard},
            (*src.devices)[p.src_shard].host));
        plan.src_regions.push_back({Shape(p.src_region.size.size(), 0), p.src_region.size});
      }
      plan.dst_starts.push_back(p.dst_start);
    }
    plans->push_back(std::move(plan));
  }
  Device* device = devices_[node.slice->local_devices[shard]].get();
  collective::CollectiveHub* hub = &collectives_;
  ComputationWatch* watch = &watch_;
  // Enqueued now, in the order runs are applied here; the device waits for the inputs when it
  // reaches the item (an in-order stream, like an accelerator's).
  Future<std::vector<BufferPtr>> inputs = JoinAll(piece_futures);
  // The closure holds the program, and so the node's plan, until the work is done (the client
  // may be collected meanwhile).
  device->Enqueue([device, exe, plans, outputs, entry, node_index, shard, fail, label, hub, watch,
                   memory_wait = options_.memory_wait, inputs = std::move(inputs), tracker = std::move(tracker),
                   donations_dropped = std::move(donations_dropped)]() {
    const NodePlan& node_plan = entry->nodes[node_index];
    const std::vector<int>& donors = entry->lowered->nodes()[node_index].output_donors;
    if (!donors.empty()) (void)donations_dropped.Await();  // at once, unless the run's op is still being set up
    const std::string& function_name = label.name;
    // Work of a client that went away still runs once it is on the device (every host of the
    // island stopped that client at the same point of the island's order), but its collectives
    // no longer wait for anyone (CollectiveHub::ClientGone): a host of its gang may never have
    // started the run. What it produces is freed as soon as it is done.
    const absl::StatusOr<std::vector<BufferPtr>>& pieces = inputs.Await();
    if (!pieces.ok()) {
      // Named once, by the first node whose input failed: down a chain every node would name its
      // own again (a stencil failing 800 timesteps from its end read 24 KB of "input of ...").
      const absl::Status failed =
          absl::StartsWith(pieces.status().message(), kInputOf)
              ? pieces.status()
              : absl::Status(pieces.status().code(), absl::StrCat(kInputOf, function_name, "' (shard ", shard,
                                                                  "): ", pieces.status().message()));
      Withdraw(*hub, node_plan, label, 0, failed);
      fail(failed);
      tracker->ShardDone(0);
      return;
    }
    int calls = 0;  // the collective calls the body made
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
      for (size_t j = 0; j < node_plan.out_specs.size(); ++j) {
        const TensorSpec& spec = node_plan.out_specs[j];
        const int donor = donors.empty() ? -1 : donors[j];  // empty: the node takes none
        if (donor >= 0) {
          // References this work holds itself: `inputs`, and the pieces it was assembled from.
          BufferPtr& in = inputs[static_cast<size_t>(donor)];
          const long held = 1 + std::count(pieces->begin(), pieces->end(), in);
          PW_ASSIGN_OR_RETURN(BufferPtr out, DonatedBuffer(*device, memory_wait, in, held));
          in = out;  // the body sees input and output as one buffer
          results.push_back(std::move(out));
          continue;
        }
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
      ScopedStopRequest stop(watch->StopFlag(device->local_index()));
      absl::Status ran = exe->Run(in_ptrs, out_ptrs);
      if (!ran.ok()) {
        // Asked to stop past the computation timeout: the host's reason, not the body's words.
        if (std::optional<std::string> why = watch->StopReason(device->local_index()); why.has_value()) {
          ran = absl::DeadlineExceededError(*why);
        }
      }
      calls = collectives.calls();
      PW_RETURN_IF_ERROR(ran);
      return results;
    };
    const absl::Time start = absl::Now();
    watch->Begin(device->local_index(), label, start);
    absl::StatusOr<std::vector<BufferPtr>> results;
    {
      absl::Cleanup ended = [&] { watch->End(device->local_index()); };  // however run() ends
      // What the body allocates holds nothing another client left in that memory.
      HostMemory::Owner owner(absl::HashOf(label.client) | 1);
      results = run();
    }
    const int64_t start_us = absl::ToUnixMicros(start);
    const int64_t end_us = absl::ToUnixMicros(absl::Now());
    device->RecordTrace({label, start_us, end_us});  // before results show
    if (!results.ok()) Withdraw(*hub, node_plan, label, calls, results.status());  // before the run counts as done
    tracker->ShardDone(end_us - start_us);
    if (!results.ok()) {
      fail(results.status());
      return;
    }
    for (size_t j = 0; j < results->size(); ++j) (*outputs)[j].Set((*results)[j]);
  });
}

}  // namespace pathways
