// ClientCore: what the client library keeps per client (leases, slice mappings, the ordered
// queues to hosts and to the island schedulers).
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <thread>

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

// Runs each task once its time comes, on one thread for the process (never joined: a task holds
// only what it runs for).
class Later {
 public:
  static Later& Get() {
    static Later* later = new Later();
    return *later;
  }
  void After(absl::Duration delay, absl::AnyInvocable<void() &&> task) {
    absl::MutexLock lock(&mu_);
    auto it = tasks_.emplace(absl::Now() + delay, std::move(task));
    if (it == tasks_.begin()) wake_.Signal();  // else the thread already wakes before it is due
  }

 private:
  Later() {
    std::thread([this] {
      NameThisThread("client-later");
      absl::MutexLock lock(&mu_);
      while (true) {
        const absl::Time next = tasks_.empty() ? absl::InfiniteFuture() : tasks_.begin()->first;
        if (absl::Now() < next) {
          wake_.WaitWithDeadline(&mu_, next);  // or woken by After
          continue;
        }
        absl::AnyInvocable<void() &&> task = std::move(tasks_.begin()->second);
        tasks_.erase(tasks_.begin());
        mu_.Unlock();
        std::move(task)();
        mu_.Lock();
      }
    }).detach();
  }
  absl::Mutex mu_;
  absl::CondVar wake_;
  std::multimap<absl::Time, absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
};

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
    // Held also while frees held before wait for a run (kFreeWait): the run that carries those
    // carries this one.
    if ((runs_undelivered_ > 0 || !held_frees_.empty()) && held_bytes_ + shard_bytes <= kMaxHeldBytes) {
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
    mapping->devices.push_back({DeviceId(d.device_id()), HostId(d.host_id()), d.host_address(), d.local_index(),
                                d.island(), std::vector<int32_t>(d.coords().begin(), d.coords().end()), d.incarnation(),
                                d.memory_capacity()});
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
  lease_thread_ = std::thread([this, interval] {
    NameThisThread("client-lease");
    LeaseLoop(interval);
  });
  return absl::OkStatus();
}

void ClientCore::LeaseLoop(absl::Duration interval) {
  while (!lease_stop_.WaitForNotificationWithTimeout(interval)) {
    auto next = controller_->ClientHeartbeat(identity_, /*goodbye=*/false);
    if (next.ok()) {
      interval = *next;
    } else if (next.status().code() == absl::StatusCode::kFailedPrecondition) {
      // The controller refuses this client for good (a computation of its held a device past its
      // host's computation timeout), or it went away there (its lease lapsed while this process
      // was paused, say) and what it held is collected: said once, and no more renewals.
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

rpc::ScheduleRequest ClientCore::ScheduleRequestOf(const ClientIdentity& identity, double weight,
                                                  const std::vector<QueuedRun>& runs, bool name_hosts) {
  rpc::ScheduleRequest request;
  request.set_client_id(identity.id);
  request.set_credential(identity.credential);
  request.set_weight(weight);
  // The first run of each epoch in the request is enough: the controller restates the epoch
  // from it, and the runs after it follow (a request of many runs stays small).
  absl::flat_hash_set<std::pair<int64_t, int64_t>> named;
  for (const QueuedRun& r : runs) {
    rpc::GangRun* run = request.add_runs();
    *run = r.run;
    if (!name_hosts) continue;
    if (!named.insert({run->group(), run->group_epoch()}).second || run->hosts_size() > 0) continue;
    r.place.epoch->NameHosts(r.place.run, *run);
  }
  return request;
}

std::shared_ptr<OrderedBatchQueue<ClientCore::QueuedRun>> ClientCore::ScheduleQueue() {
  absl::MutexLock lock(&mu_);
  auto& q = schedule_queue_;
  if (q == nullptr) {
    q = std::make_shared<OrderedBatchQueue<QueuedRun>>(
        [controller = controller_, identity = identity_, weight = options_.weight,
         named_again = runs_named_again_](std::vector<QueuedRun> runs) {
          const bool implicit =
              std::any_of(runs.begin(), runs.end(), [](const QueuedRun& r) { return r.run.hosts_size() == 0; });
          Future<Unit> sent = controller->Schedule(ScheduleRequestOf(identity, weight, runs, /*name_hosts=*/false));
          if (!implicit) return sent;
          // A controller that does not know a run's epoch (it restarted, or an earlier request
          // was lost) scheduled none of them: the same runs again, naming their hosts, keep their
          // places and the client's order.
          Promise<Unit> done;
          Future<Unit> answered = done.future();
          sent.OnReady([controller, identity, weight, named_again, runs = std::move(runs),
                        done = std::move(done)](const absl::StatusOr<Unit>& r) mutable {
            if (r.ok() || !IsRunGroupOutOfStep(r.status())) {
              done.Set(r);
              return;
            }
            PW_LOG(Info) << "client " << identity.id << ": the controller does not know a run group's epoch ("
                         << r.status().message() << "); " << runs.size() << " runs go again naming their hosts";
            named_again->fetch_add(static_cast<int64_t>(runs.size()), std::memory_order_relaxed);
            controller->Schedule(ScheduleRequestOf(identity, weight, runs, /*name_hosts=*/true))
                .OnReady([done = std::move(done)](const absl::StatusOr<Unit>& again) mutable { done.Set(again); });
          });
          return answered;
        },
        // A refused batch (a host left, say) fails its runs only. Their places are filled with
        // no-ops on the hosts still there, which would otherwise wait for them.
        [weak = weak_from_this()](std::vector<QueuedRun> runs, const absl::Status& status) {
          auto core = weak.lock();
          if (core == nullptr) return;
          core->SayRefused(runs.size(), status);
          for (const QueuedRun& run : runs) {
            const RunGroupEpoch& e = *run.place.epoch;
            for (size_t i = 0; i < e.hosts->size(); ++i) {
              auto q = core->queue((*e.hosts)[i]);
              if (q->session() == e.first[i].session)
                q->SkipReserved(e.first[i].seq + run.place.run);  // else that sequence is gone
            }
            // The frees it carried go as ops (to every host it spans; those without the array
            // ignore them).
            for (int64_t id : run.run.run().free_array_ids()) {
              for (const std::string& host : *e.hosts) core->PushFreeOp(host, id);
            }
            core->frees_carried_.fetch_sub(run.run.run().free_array_ids_size(), std::memory_order_relaxed);
          }
        },
        // Under the controller's 4 MiB message limit however many runs queue up, counting a run
        // that names only its group as if it named its hosts (about 32 bytes each: 16 KB at 512
        // hosts), as the controller will: a request stays as large there as it was before.
        OrderedBatchQueue<QueuedRun>::BatchLimit{[](const QueuedRun& run) {
                                                   const size_t named = run.run.hosts_size() > 0
                                                                            ? 0
                                                                            : run.place.epoch->hosts->size() * 32;
                                                   return run.run.ByteSizeLong() + named;
                                                 },
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
  // Not a structured binding: clang 14 (the sanitizer builds) cannot capture one in a lambda.
  const auto reserved = ReserveForFill(host);
  const auto& q = reserved.first;
  const SeqRef at{q->session(), reserved.second};
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

ClientCore::RunGroup::RunGroup(int64_t id, std::vector<std::string> hosts)
    : id(id),
      hosts(std::make_shared<const std::vector<std::string>>(std::move(hosts))),
      index([this] {
        auto index = std::make_shared<absl::flat_hash_map<std::string, int>>();
        for (size_t i = 0; i < this->hosts->size(); ++i) index->try_emplace((*this->hosts)[i], static_cast<int>(i));
        return index;
      }()) {}

std::shared_ptr<ClientCore::RunGroup> ClientCore::GroupFor(const std::vector<std::string>& hosts) {
  absl::MutexLock lock(&seq_mu_);
  std::shared_ptr<RunGroup>& g = groups_[hosts];
  if (g == nullptr) g = std::make_shared<RunGroup>(++last_group_id_, hosts);
  return g;
}

std::optional<int64_t> ClientCore::LastGroupRunLocked(const std::string& host, const std::shared_ptr<HostOpQueue>& q) {
  auto it = members_.find(host);
  if (it == members_.end() || it->second.queue != q) return std::nullopt;  // (a new queue starts anew)
  const RunGroup& g = *it->second.group;
  if (g.current == nullptr) return std::nullopt;
  std::optional<SeqRef> last = g.current->PlaceOn(host, g.next_run - 1);
  if (!last.has_value()) return std::nullopt;
  return last->seq;
}

void ClientCore::LeaveGroupLocked(const std::string& host, const std::shared_ptr<HostOpQueue>& q) {
  auto it = members_.find(host);
  if (it == members_.end()) return;
  // Its queue has not counted the places the group's runs took since the epoch began.
  if (std::optional<int64_t> last = LastGroupRunLocked(host, q)) q->CatchUp(*last);
  it->second.group->dirty = true;
  members_.erase(it);
}

std::pair<std::shared_ptr<HostOpQueue>, int64_t> ClientCore::ReserveForFill(const std::string& host) {
  absl::MutexLock lock(&seq_mu_);
  std::shared_ptr<HostOpQueue> q = queue(host);
  LeaveGroupLocked(host, q);
  return {q, q->ReserveForFill()};
}

SeqRef ClientCore::LastSeq(const std::string& host) {
  absl::MutexLock lock(&seq_mu_);
  std::shared_ptr<HostOpQueue> q = queue(host);
  SeqRef last{q->session(), q->last_seq()};
  if (std::optional<int64_t> run = LastGroupRunLocked(host, q)) last.seq = std::max(last.seq, *run);
  return last;
}

RunPlace ClientCore::PlaceRun(const std::shared_ptr<RunGroup>& self, rpc::GangRun& run) {
  RunGroup& group = *self;
  absl::MutexLock lock(&seq_mu_);
  run.set_group(group.id);
  const int64_t failures = queue_failures_->load(std::memory_order_acquire);
  if (group.current != nullptr && !group.dirty && group.failures_seen == failures) {
    run.set_group_epoch(group.current->epoch);
    run.set_group_run(group.next_run);
    return {group.current, group.next_run++};
  }
  // A new epoch: every host's place taken from its queue, and named.
  auto epoch = std::make_shared<RunGroupEpoch>();
  epoch->epoch = group.current == nullptr ? 1 : group.current->epoch + 1;
  epoch->hosts = group.hosts;
  epoch->index = group.index;
  epoch->first.reserve(group.hosts->size());
  group.failures_seen = failures;  // a queue that fails from here on makes the next run start another
  for (const std::string& host : *group.hosts) {
    std::shared_ptr<HostOpQueue> q = queue(host);
    LeaveGroupLocked(host, q);
    epoch->first.push_back({q->session(), q->ReserveSeq()});
    members_[host] = {self, q};
  }
  epoch->NameHosts(0, run);
  group.current = epoch;
  group.next_run = 1;
  group.dirty = false;
  run.set_group_epoch(epoch->epoch);
  run.set_group_run(0);
  return {std::move(epoch), 0};
}

ClientCore::PushedRun ClientCore::PushRun(const std::shared_ptr<RunGroup>& group, rpc::RunProgramOp op) {
  PushedRun pushed;
  const std::vector<std::string>& hosts = *group->hosts;
  if (options_.TEST_bypass_scheduler) {
    std::vector<Future<Unit>> deliveries;
    for (const std::string& host : hosts) {
      rpc::Op o;
      *o.mutable_run() = op;
      pushed.seqs[host] = Push(host, std::move(o));
      deliveries.push_back(queue(host)->Flushed());
    }
    pushed.delivered = AllDone(deliveries);
    return pushed;
  }
  QueuedRun queued;
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
    auto within = [&group](const std::shared_ptr<const SliceMapping>& placed_on) {
      if (group->covers.lock() == placed_on) return true;
      const std::vector<std::string>& on = placed_on->hosts;
      if (!std::all_of(on.begin(), on.end(), [&](const std::string& h) { return group->index->contains(h); })) {
        return false;
      }
      group->covers = placed_on;
      return true;
    };
    for (HeldFree& f : held) {
      if (op.free_array_ids_size() < kMaxFreesPerRun && within(f.placed_on)) {
        op.add_free_array_ids(f.id.value());
      } else {
        not_carried.push_back(std::move(f));
      }
    }
    frees_carried_.fetch_add(op.free_array_ids_size(), std::memory_order_relaxed);
    PushFreeOps(not_carried);
    // One message for the run, whichever islands it spans: the controller splits it, and orders
    // runs over several islands across them.
    *queued.run.mutable_run() = std::move(op);
    queued.place = PlaceRun(group, queued.run);
    frees_unplaced_.fetch_sub(static_cast<int64_t>(held.size()), std::memory_order_release);
  }
  pushed.place = queued.place;
  run_ops_sent_.fetch_add(1, std::memory_order_relaxed);
  run_op_bytes_sent_.fetch_add(static_cast<int64_t>(queued.run.ByteSizeLong()), std::memory_order_relaxed);
  if (queued.run.hosts_size() > 0) runs_naming_hosts_.fetch_add(1, std::memory_order_relaxed);
  auto queue = ScheduleQueue();
  const int64_t number = queue->Push(std::move(queued));
  Future<Unit> delivered = queue->FlushedThrough(number);  // this run's batch
  // Delivered or refused: when it was the last on its way, what is held waits kFreeWait for
  // another run to carry it, and then goes as free ops (a loop that waits for each run's result
  // pushes its next run well within that, which then names only its group: see RunGroup).
  delivered.OnReady([weak = weak_from_this()](const absl::StatusOr<Unit>&) {
    auto self = weak.lock();
    if (self == nullptr) return;
    {
      absl::MutexLock lock(&self->free_mu_);
      self->last_delivery_ = absl::Now();
      if (--self->runs_undelivered_ > 0 || self->held_frees_.empty() || self->free_check_pending_) return;
      self->free_check_pending_ = true;
    }
    Later::Get().After(kFreeWait, [weak] {
      if (auto self = weak.lock()) self->CheckHeldFrees();
    });
  });
  pushed.delivered = std::move(delivered);
  return pushed;
}

void ClientCore::CheckHeldFrees() {
  {
    absl::MutexLock lock(&free_mu_);
    if (runs_undelivered_ > 0 || held_frees_.empty()) {
      free_check_pending_ = false;  // the next delivery looks again
      return;
    }
    const absl::Time due = last_delivery_ + kFreeWait;
    if (absl::Now() < due) {
      // Runs were delivered since this check was set: it moves to kFreeWait after the last.
      Later::Get().After(due - absl::Now(), [weak = weak_from_this()] {
        if (auto self = weak.lock()) self->CheckHeldFrees();
      });
      return;
    }
    free_check_pending_ = false;
  }
  PushHeldFrees();
}

absl::Status ClientCore::CompileOn(CompiledFunction::State& fn,
                                   const std::vector<std::string>& hosts) {
  rpc::CompileRequest request;
  *request.mutable_body() = ToProto(fn.spec.body);
  request.set_client_id(id());
  request.set_credential(credential());
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
