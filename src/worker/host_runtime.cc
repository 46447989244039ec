#include "worker/host_runtime.h"

#include <cstring>
#include <set>

#include "core/socket_util.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "array/sharding.h"
#include "collective/tcp_links.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "dataflow/graph.h"
#include "transport/rpc_util.h"
#include "worker/input_assembly.h"

namespace pathways {
namespace {

// Links to other hosts when the host has somewhere to meet them; collectives stay within the
// host otherwise.
std::shared_ptr<collective::TcpLinks> LinksFor(const HostRuntimeOptions& options, DcnEmulation* dcn) {
  if (options.rendezvous == nullptr) return nullptr;
  const std::string ip = HostOfAddress(options.name);
  auto links =
      collective::TcpLinks::Create(options.name, ip, options.rendezvous, dcn, options.cluster_token, options.links_port);
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
      watch_(options_.num_devices),
      functions_(options_.backend.compiler(), options_.compiled_memory_bytes,
                 options_.compiled_memory_per_client_bytes),
      io_pool_(options_.name + "-io", 2),
      dataflow_transport_(options_.name),
      dcn_transport_(dcn_ != nullptr ? std::make_unique<dataflow::DcnTransport>(dataflow_transport_, *dcn_) : nullptr),
      sequencer_([this](const std::string& client, const rpc::Op& op) { ApplyOp(client, op); },
                 [this](const std::string& client) { CollectClient(client); }, options_.sequence_gap_timeout,
                 OpSequencer::Limits{},
                 [this](const std::string& client, const absl::Status& why) {
                   {
                     absl::MutexLock lock(&programs_mu_);  // a client gone has nothing read any more
                     if (!CheckNotCollectedLocked(client).ok()) return;
                   }
                   store_.NoteSkippedOps(client, why);
                 }),
      control_({options_.name, options_.dataflow_service, &dataflow_transport_, &io_pool_,
                [this](std::vector<rpc::ScheduledOp> ops) { return ApplyScheduled(std::move(ops)); }}) {
  ConfigureComputeThreads(options_.intra_op_threads);
  for (int i = 0; i < options_.num_devices; ++i) {
    devices_.push_back(options_.backend.MakeDevice(i, options_.device_memory_bytes, options_.name, options_.memory_wait));
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
  if (options_.dataflow_service != nullptr) {
    absl::MutexLock lock(&programs_mu_);
    for (const auto& [key, program] : programs_) options_.dataflow_service->RemoveEngine(program->engine->graph().name());
  }
  engines_.ShutdownAll();  // batches still queued hold them; their operators refer to this host
  blocks_.reset();  // fails blocks still queued; nothing lands in the store after this
  io_pool_.Shutdown();
  ThreadPool* delay_pool;  // set once, by a test; shut down unlocked (its ops take the lock)
  {
    absl::MutexLock lock(&programs_mu_);
    delay_pool = test_delay_pool_.get();
  }
  if (delay_pool != nullptr) {
    test_delay_stop_.Notify();
    delay_pool->Shutdown();
  }
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

absl::StatusOr<std::string> HostRuntime::Compile(const rpc::FunctionBodyProto& proto,
                                                 const FunctionCache::Owner& owner) {
  auto collected = [&] {
    absl::MutexLock lock(&programs_mu_);
    return CheckNotCollectedLocked(owner.client);
  };
  PW_RETURN_IF_ERROR(collected());
  PW_ASSIGN_OR_RETURN(FunctionBody body, FromProto(proto));
  PW_RETURN_IF_ERROR(functions_.Compile(body, owner).status());
  // Collected while it compiled: the collection may have released the client before the function
  // was kept for it.
  if (absl::Status gone = collected(); !gone.ok()) {
    functions_.Release(owner.client);
    return gone;
  }
  return FunctionKey(body);
}

absl::Status HostRuntime::CheckDevice(int device) const {
  if (device >= 0 && device < num_devices()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("device ", device, " does not exist on ", name(), " (", num_devices(), " devices)"));
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
      PW_RETURN_IF_ERROR(CheckDevice(op.put().local_device()));
      if (op.put().staged() && !op.put().data().empty()) {
        return absl::InvalidArgumentError("a staged put carries bytes of its own");
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
  if (test_op_delays_set_.load(std::memory_order_relaxed)) {
    absl::MutexLock lock(&programs_mu_);
    auto it = test_op_delays_.find(request.client_id());
    if (it != test_op_delays_.end() && it->second > absl::ZeroDuration()) {
      test_delay_pool_->Schedule(
          [this, client = request.client_id(), ops = std::move(ops), due = absl::Now() + it->second]() mutable {
            if (!test_delay_stop_.WaitForNotificationWithDeadline(due))
              (void)sequencer_.AddDirect(client, std::move(ops));
          });
      return status;
    }
  }
  absl::Status sequenced = sequencer_.AddDirect(request.client_id(), std::move(ops));
  return status.ok() ? sequenced : status;
}

void HostRuntime::SetDepartedPeers(const absl::flat_hash_map<std::string, std::string>& why) {
  if (links_ == nullptr) return;
  absl::flat_hash_map<std::string, std::string> departed = why;
  {
    absl::MutexLock lock(&live_mu_);
    for (const std::string& host : live_hosts_) departed.erase(host);
  }
  links_->SetDeparted(std::move(departed));
}

absl::Status HostRuntime::JoinControlGraph(const rpc::ControlGraph& graph) {
  PW_RETURN_IF_ERROR(control_.Join(graph));
  if (links_ == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&live_mu_);
  // A controller that restarted numbers its generations afresh.
  if (graph.controller_incarnation() == live_incarnation_ && graph.generation() <= live_generation_) {
    return absl::OkStatus();
  }
  live_incarnation_ = graph.controller_incarnation();
  live_generation_ = graph.generation();
  live_hosts_ = {graph.hosts().begin(), graph.hosts().end()};
  links_->Returned({graph.hosts().begin(), graph.hosts().end()});
  return absl::OkStatus();
}

absl::Status HostRuntime::ApplyScheduled(std::vector<rpc::ScheduledOp> ops) {
  // One malformed op does not hold back the valid ones of its batch (other clients' runs). One
  // with a client keeps its place in that client's sequence as a skip, so the client's later ops
  // do not wait for it forever; one without a client has no sequence to keep.
  absl::Status status;
  std::vector<rpc::ScheduledOp> valid;
  valid.reserve(ops.size());
  for (rpc::ScheduledOp& op : ops) {
    if (!op.client_id().empty() && (op.op().has_run() || op.retire_client())) {
      valid.push_back(std::move(op));
      continue;
    }
    if (status.ok()) {
      status = absl::InvalidArgumentError(
          absl::StrCat("a scheduled op must be a run or a retirement, with a client id (order ", op.order(), ")"));
    }
    if (op.client_id().empty() || op.op().seq() <= 0) continue;
    op.mutable_op()->mutable_skip();
    valid.push_back(std::move(op));
  }
  PW_RETURN_IF_ERROR(sequencer_.AddScheduled(std::move(valid)));
  return status;
}

bool HostRuntime::CollectClient(const std::string& client) {
  std::vector<std::shared_ptr<HostProgram>> programs;
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
    staged_.erase(client);
  }
  const absl::Status gone = absl::CancelledError(absl::StrCat("client ", client, " went away"));
  // Its collectives stop waiting: a run of it that some host of its gang never started (its
  // program never reached that host) would hold this host's devices until the timeout.
  collectives_.ClientGone(client, gone);
  for (const auto& p : programs) options_.dataflow_service->RemoveEngine(p->engine->graph().name());
  const int dropped = store_.DropClient(client, gone);
  const int functions = functions_.Release(client);
  PW_LOG(Info) << "host " << name() << " collected client " << client << ": " << dropped << " shards, "
               << programs.size() << " programs, " << functions << " functions";
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
      // The frees it carries first: they free memory its outputs may need, and none of them is
      // one of its inputs (the client dropped them before it pushed the run).
      for (int64_t id : op.run().free_array_ids()) store_.FreeArray(client, ArrayId(id));
      s = RunProgram(client, op.run());
      // Nothing of the run was set up here: what it was to make fails with the reason.
      if (!s.ok()) {
        store_.FailArrays(client, ArrayId(op.run().output_array_base()),
                          std::clamp<int64_t>(op.run().num_output_arrays(), 0, int64_t{1} << 20), s);
      }
      break;
    case rpc::Op::kPut: Put(client, op.put()); break;
    case rpc::Op::kFree: store_.FreeArray(client, ArrayId(op.free().array_id())); break;
    case rpc::Op::kSkip: break;
    default: s = absl::InternalError("op of unknown kind was applied"); break;  // ValidateOp refuses these
  }
  // Also in the failures of what the op was to make (above), for whoever reads them.
  if (!s.ok()) PW_LOG(Warning) << "host " << name() << ", client " << client << ", op " << op.seq() << ": " << s;
}

}  // namespace pathways
