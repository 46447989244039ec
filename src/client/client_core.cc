// ClientCore: what the client library keeps per client (leases, slice mappings, the ordered
// queues to hosts and to the island schedulers).
#include <algorithm>
#include <limits>
#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "client/client_core.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "transport/rpc_util.h"

namespace pathways {

namespace {

// Sends the batches that frees start. Starting a gRPC call costs tens of microseconds on the
// calling thread (60-70 on the development VM), and a handle usually dies on the user's thread
// between two calls (`x = f(x)`): there, a free sent inline added that to every round trip. The
// free still takes its place in the host's order where it is pushed. One thread for the
// process, never joined (a task holds only the queue it sends for).
Executor& FreeSender() {
  static ThreadPool* pool = new ThreadPool("client-frees", 1);
  return *pool;
}

}  // namespace

ShardedArray::State::~State() {
  if (!owned) return;
  const int64_t shard_bytes = ByteSize(spec.dtype, sharding.local_shape()).value_or(std::numeric_limits<int64_t>::max());
  dispatched.OnReady([core = core, id = id, placed_on = placed_on, shard_bytes](const absl::StatusOr<Unit>&) mutable {
    core->Free(id, std::move(placed_on), shard_bytes);
  });
}

void ClientCore::Free(ArrayId id, std::shared_ptr<const SliceMapping> placed_on, int64_t shard_bytes) {
  if (shard_bytes <= kMaxCarriedShardBytes) {
    absl::MutexLock lock(&free_mu_);
    if (runs_undelivered_ > 0 && held_bytes_ + shard_bytes <= kMaxHeldBytes) {
      held_frees_.push_back({id, std::move(placed_on), shard_bytes});
      held_bytes_ += shard_bytes;
      frees_unplaced_.fetch_add(1, std::memory_order_release);
      return;
    }
  }
  PushFreeOps({{id, std::move(placed_on), shard_bytes}});
}

void ClientCore::PushFreeOp(const std::string& host, int64_t id) {
  rpc::Op op;
  op.mutable_free()->set_array_id(id);
  Push(host, std::move(op), &FreeSender());
}

void ClientCore::PushFreeOps(const std::vector<HeldFree>& frees) {
  for (const HeldFree& f : frees) {
    for (const std::string& host : f.placed_on->hosts) PushFreeOp(host, f.id.value());
  }
}

std::shared_ptr<const SliceMapping> ClientCore::NewMapping(const rpc::AllocateSliceResponse& response) {
  auto mapping = std::make_shared<SliceMapping>();
  mapping->id = mapping_ids_.Next();
  for (const auto& d : response.devices()) {
    mapping->devices.push_back({DeviceId(d.device_id()), HostId(d.host_id()), d.host_address(), d.local_index(), d.island(),
                                std::vector<int32_t>(d.coords().begin(), d.coords().end()), d.incarnation()});
    NoteHost(d.host_address(), d.incarnation());
    if (std::find(mapping->hosts.begin(), mapping->hosts.end(), d.host_address()) == mapping->hosts.end()) {
      mapping->hosts.push_back(d.host_address());
    }
  }
  // The controller placed the slice on live hosts; one that restarted since this client last
  // used it has a channel still waiting to reconnect. Bounded: a host that does not answer is
  // reported by the calls that need it.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (const std::string& host : mapping->hosts) (void)worker(host)->WaitUntilConnected(deadline);
  return mapping;
}

absl::Status ClientCore::StartLease() {
  if (options_.schedule_stream) controller_->PreferScheduleStream();
  PW_ASSIGN_OR_RETURN(absl::Duration interval, controller_->ClientHeartbeat(identity_, /*goodbye=*/false));
  lease_thread_ = std::thread([this, interval] { LeaseLoop(interval); });
  return absl::OkStatus();
}

void ClientCore::LeaseLoop(absl::Duration interval) {
  while (!lease_stop_.WaitForNotificationWithTimeout(interval)) {
    auto next = controller_->ClientHeartbeat(identity_, /*goodbye=*/false);
    if (next.ok()) {
      interval = *next;
    } else if (next.status().code() == absl::StatusCode::kFailedPrecondition) {
      // The controller refuses this client for good (a computation of its held a device past its
      // host's computation timeout): said once, and no more renewals.
      PW_LOG(Error) << "client " << id() << ": " << next.status();
      return;
    } else {
      PW_LOG(Warning) << "client " << id() << " could not renew its lease: " << next.status();
    }
  }
  (void)controller_->ClientHeartbeat(identity_, /*goodbye=*/true);
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
        [controller = controller_, identity = identity_, weight = options_.weight](std::vector<rpc::GangRun> runs) {
          rpc::ScheduleRequest request;
          request.set_client_id(identity.id);
          request.set_credential(identity.credential);
          request.set_weight(weight);
          for (rpc::GangRun& r : runs) *request.add_runs() = std::move(r);
          return controller->Schedule(std::move(request));
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
            // The frees it carried go as ops (to every host it named; those without the array
            // ignore them).
            for (int64_t id : run.run().free_array_ids()) {
              for (const rpc::HostSeq& h : run.hosts()) core->PushFreeOp(h.host(), id);
            }
            core->frees_carried_.fetch_sub(run.run().free_array_ids_size(), std::memory_order_relaxed);
          }
        },
        // Under the controller's 4 MiB message limit however many runs queue up (a run names each
        // of its hosts: 16 KB at 512 hosts).
        OrderedBatchQueue<rpc::GangRun>::BatchLimit{[](const rpc::GangRun& run) { return run.ByteSizeLong(); },
                                                    size_t{1} << 20});
  }
  return q;
}

SeqRef ClientCore::PushPut(const std::string& host, rpc::Op op, std::shared_ptr<std::string> bytes) {
  PushHeldFrees();  // (Push does too, but a staged put takes its place here)
  if (bytes->size() < kStagedPutBytes || !worker(host)->HasStream()) {
    // In the op. Bytes no other shard shares are moved there, not copied.
    *op.mutable_put()->mutable_data() = bytes.use_count() == 1 ? std::move(*bytes) : *bytes;
    return Push(host, std::move(op));
  }
  std::shared_ptr<HostOpQueue> q = queue(host);
  const SeqRef at{q->session(), q->ReserveForFill()};
  rpc::StageRequest stage;
  stage.set_client_id(id());
  stage.set_credential(credential());
  *stage.mutable_dest() = op.put().dest();
  stage.set_local_device(op.put().local_device());
  *stage.mutable_spec() = op.put().spec();
  worker(host)->Stage(stage, bytes).OnReady(
      [weak = weak_from_this(), q, seq = at.seq, op = std::move(op), bytes](const absl::StatusOr<Unit>& r) mutable {
        if (r.ok()) {
          op.mutable_put()->set_staged(true);
        } else {
          *op.mutable_put()->mutable_data() = *bytes;  // the in-order way, which also says why it fails
        }
        if (auto self = weak.lock()) {  // (the queue goes on without it: the host then collects the client)
          if (r.ok()) self->staged_put_bytes_.fetch_add(static_cast<int64_t>(bytes->size()), std::memory_order_relaxed);
          self->ops_sent_.fetch_add(1, std::memory_order_relaxed);
          self->op_bytes_sent_.fetch_add(static_cast<int64_t>(op.ByteSizeLong()), std::memory_order_relaxed);
        }
        q->FillReserved(seq, std::move(op));
      });
  return at;
}

namespace {

// Whether every host of `inner` is one of `outer`'s, made into a set the first time it is needed.
bool HostsWithin(const std::vector<std::string>& inner, const std::vector<std::string>& outer,
                 std::optional<absl::flat_hash_set<std::string_view>>& outer_set) {
  if (inner == outer) return true;  // a loop over one slice: the same hosts in the same order
  if (inner.size() > outer.size()) return false;
  if (!outer_set.has_value()) outer_set.emplace(outer.begin(), outer.end());
  return std::all_of(inner.begin(), inner.end(), [&](const std::string& h) { return outer_set->contains(h); });
}

}  // namespace

ClientCore::PushedRun ClientCore::PushRun(const std::vector<std::string>& hosts, rpc::RunProgramOp op) {
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
  rpc::GangRun run;
  {
    // The frees held since the last run: this run carries those whose hosts it reaches, the rest
    // go as ops before it; nothing else takes a place on the hosts until the run has its places.
    // The run is counted until it is delivered, so that frees meanwhile wait for the next run.
    absl::MutexLock order(&free_order_mu_);
    std::vector<HeldFree> held, not_carried;
    {
      absl::MutexLock lock(&free_mu_);
      ++runs_undelivered_;
      held = TakeHeldLocked();
    }
    std::optional<absl::flat_hash_set<std::string_view>> run_hosts;
    for (HeldFree& f : held) {
      if (op.free_array_ids_size() < kMaxFreesPerRun && HostsWithin(f.placed_on->hosts, hosts, run_hosts)) {
        op.add_free_array_ids(f.id.value());
      } else {
        not_carried.push_back(std::move(f));
      }
    }
    frees_carried_.fetch_add(op.free_array_ids_size(), std::memory_order_relaxed);
    PushFreeOps(not_carried);
    // One message for the run, whichever islands it spans: the controller splits it, and orders
    // runs over several islands across them.
    *run.mutable_run() = std::move(op);
    for (const std::string& host : hosts) {
      rpc::HostSeq* h = run.add_hosts();
      h->set_host(host);
      std::shared_ptr<HostOpQueue> q = queue(host);
      seqs[host] = {q->session(), q->ReserveSeq()};
      h->set_seq(seqs[host].seq);
      h->set_session(seqs[host].session);
    }
    frees_unplaced_.fetch_sub(static_cast<int64_t>(held.size()), std::memory_order_release);
  }
  run_ops_sent_.fetch_add(1, std::memory_order_relaxed);
  run_op_bytes_sent_.fetch_add(static_cast<int64_t>(run.ByteSizeLong()), std::memory_order_relaxed);
  auto queue = ScheduleQueue();
  const int64_t number = queue->Push(std::move(run));
  Future<Unit> delivered = queue->FlushedThrough(number);  // this run's batch
  // Delivered or refused: when it was the last on its way, what is held goes as free ops.
  delivered.OnReady([weak = weak_from_this()](const absl::StatusOr<Unit>&) {
    auto self = weak.lock();
    if (self == nullptr) return;
    {
      absl::MutexLock lock(&self->free_mu_);
      if (--self->runs_undelivered_ > 0) return;
    }
    self->PushHeldFrees();
  });
  deliveries.push_back(std::move(delivered));
  pushed.delivered = AllDone(deliveries);
  return pushed;
}

absl::Status ClientCore::CompileOn(CompiledFunction::State& fn,
                                   const std::vector<std::string>& hosts) {
  rpc::CompileRequest request;
  *request.mutable_body() = ToProto(fn.spec.body);
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

}  // namespace pathways
