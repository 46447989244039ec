// Internals of the client library shared by its source files: the state behind Client and
// behind every handle it gives out. Not part of the public API.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "client/program.h"
#include "core/log_limiter.h"
#include "core/logging.h"
#include "transport/controller_client.h"
#include "transport/worker_client.h"

namespace pathways {

// A place in a client's sequence of ops for one host.
struct SeqRef {
  int64_t session = 0;
  int64_t seq = 0;
};

// One epoch of a run group (ClientCore::RunGroup): run 0 of it took `first` on each host, and
// run k takes first + k, since nothing else took a place on those hosts in between. Immutable.
struct RunGroupEpoch {
  int64_t epoch = 0;
  std::shared_ptr<const std::vector<std::string>> hosts;
  std::shared_ptr<const absl::flat_hash_map<std::string, int>> index;  // of each host in `hosts`
  std::vector<SeqRef> first;
  std::optional<SeqRef> PlaceOn(const std::string& host, int64_t run) const {
    auto it = index->find(host);
    if (it == index->end()) return std::nullopt;
    const SeqRef& f = first[static_cast<size_t>(it->second)];
    return SeqRef{f.session, f.seq + run};
  }
  // Names every host of run `run` with its place there (rpc::GangRun.hosts).
  void NameHosts(int64_t run, rpc::GangRun& gang) const {
    gang.mutable_hosts()->Reserve(static_cast<int>(hosts->size()));
    for (size_t i = 0; i < hosts->size(); ++i) {
      rpc::HostSeq* h = gang.add_hosts();
      h->set_host((*hosts)[i]);
      h->set_seq(first[i].seq + run);
      h->set_session(first[i].session);
    }
  }
};

// Where one pushed run went: run `run` of `epoch`.
struct RunPlace {
  std::shared_ptr<const RunGroupEpoch> epoch;
  int64_t run = 0;
  std::optional<SeqRef> On(const std::string& host) const { return epoch->PlaceOn(host, run); }
};

// Shared by the Client and every handle it gave out, so handles can free their shards even after
// the Client object is gone. Thread-safe.
class ClientCore : public std::enable_shared_from_this<ClientCore> {
 public:
  ClientCore(std::string controller_address, ClientOptions options)
      : serial_(NextSerial()),
        identity_(NewClientIdentity()),
        options_(options),
        controller_(std::make_shared<ControllerClient>(std::move(controller_address), options_.token)) {}

  // Says goodbye to the controller: workers then free whatever the client still owned.
  ~ClientCore();
  const std::string& id() const { return identity_.id; }
  // Unique among the clients of this process, never reused (unlike an address): what handles
  // record as their owner, so a handle of a client that is gone never passes for a new one's.
  uint64_t serial() const { return serial_; }
  // What every call that acts for this client carries (see ClientIdentity).
  const std::string& credential() const { return identity_.credential; }
  ControllerClient& controller() { return *controller_; }
  // Holds the client's lease with the controller while the core lives (a thread renews it).
  // Fails if the controller cannot be reached.
  absl::Status StartLease();
  const std::shared_ptr<RequestPaths>& request_paths() const { return request_paths_; }
  std::shared_ptr<WorkerClient> worker(const std::string& address) {
    return WorkerClientCache::Global().Get(address, options_.token);
  }

  // The scheduler refused `n` runs: said at most once a minute (a loop over a host that left has
  // every run refused, seen as thousands of lines), with how many went unsaid.
  void SayRefused(size_t n, const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    if (!refused_log_.Say(static_cast<int64_t>(n))) return;
    PW_LOG(Warning) << n << " runs refused by the scheduler: " << why
                    << refused_log_.Unsaid("more refused since the last said");
  }

  // The client's ordered queue to a host. A queue whose delivery stopped (the host refused a
  // batch, or died) is replaced by a new one, with a new session, so that a host that restarted
  // at the same address is usable again.
  std::shared_ptr<HostOpQueue> queue(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto& q = queues_[address];
    if (q && q->failed()) {
      // Said once per broken sequence (at most once a minute per host: runs sent to a dead host
      // break a sequence each), and kept for the errors of arrays that were made in it.
      absl::Status why = q->failure();
      LogLimiter& said = break_log_.try_emplace(address, absl::Minutes(1)).first->second;
      if (said.Say()) {
        PW_LOG(Warning) << "client " << identity_.id << ": host " << address << " stopped taking ops (" << why
                        << "); a new sequence starts" << said.Unsaid("more breaks since the last said");
      }
      auto& broken = breaks_[address];
      if (broken.size() >= kBreaksKept) broken.erase(broken.begin());  // sessions are random: any one goes
      broken[q->session()] = std::move(why);
    }
    if (!q || q->failed()) q = std::make_shared<HostOpQueue>(worker(address), identity_, request_paths_, queue_failures_);
    return q;
  }
  // Why the sequence `session` of ops to `address` broke; OK if that is not known (it did not,
  // or it broke too long ago).
  absl::Status BreakOf(const std::string& address, int64_t session) {
    absl::MutexLock lock(&mu_);
    auto it = breaks_.find(address);
    if (it == breaks_.end()) return absl::OkStatus();
    auto s = it->second.find(session);
    return s == it->second.end() ? absl::OkStatus() : s->second;
  }

  // Compiles the function on each host in parallel and waits for all; the first error wins.
  absl::Status CompileOn(CompiledFunction::State& fn, const std::vector<std::string>& hosts);

  ArrayId NextArrayId() { return array_ids_.Next(); }
  absl::Mutex& epoch_mu() ABSL_LOCK_RETURNED(epoch_mu_) { return epoch_mu_; }
  // A contiguous block of `n` array ids (a run's outputs are named base + offset on the hosts).
  ArrayId ReserveArrayIds(int64_t n) { return array_ids_.Reserve(n); }
  RunId NextRunId() { return run_ids_.Next(); }
  // Strictly increasing per client: hosts require a client's epochs in increasing order.
  Epoch NextEpoch() { return epochs_.Next(); }

  // Every op the client sends goes through here, so the stats see all of them.
  // Returns the op's place in the client's sequence on the host. Frees held for the next run go
  // first (see Free).
  SeqRef Push(const std::string& host, rpc::Op op, Executor* sender = nullptr) {
    if (!op.has_free()) PushHeldFrees();
    const int64_t bytes = static_cast<int64_t>(op.ByteSizeLong());
    ops_sent_.fetch_add(1, std::memory_order_relaxed);
    op_bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
    if (op.has_run()) {
      run_ops_sent_.fetch_add(1, std::memory_order_relaxed);
      run_op_bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
    }
    std::shared_ptr<HostOpQueue> q;
    HostOpQueue::Pushed pushed;
    {
      // Numbered and queued in the host's order under the lock; sent outside it.
      absl::MutexLock lock(&seq_mu_);
      q = queue(host);
      LeaveGroupLocked(host, q);
      pushed = q->PushLeavingSend(std::move(op), sender);
    }
    const int64_t seq = pushed.seq;
    q->SendPushed(std::move(pushed));
    return {q->session(), seq};
  }
  // A put of `bytes` (the op without them): shards of at least kStagedPutBytes go ahead over the
  // host's data stream when it has one, straight into device memory, and the op follows in the
  // client's order without them; smaller ones, and those the stream cannot take, travel in the
  // op through gRPC. Returns the op's place in the client's sequence on the host.
  SeqRef PushPut(const std::string& host, rpc::Op op, std::shared_ptr<std::string> bytes);
  static constexpr size_t kStagedPutBytes = 64 << 10;
  // A slice mapping from the controller's placement (a new id each time).
  std::shared_ptr<const SliceMapping> NewMapping(const rpc::AllocateSliceResponse& response);
  // A host as one worker process: its address and incarnation as far as the client knows, so
  // that what was done on a process (compiling a function) is done again on its successor.
  std::string HostKey(const std::string& host) {
    absl::MutexLock lock(&mu_);
    auto it = incarnation_of_.find(host);
    return it == incarnation_of_.end() ? host : absl::StrCat(host, "#", it->second);
  }
  // What the slices that name a host say about its worker process's incarnation. A new
  // incarnation means the host restarted: the client's sequence of ops for it starts anew (a new
  // queue and session), since the new process knows nothing of the old one.
  void NoteHost(const std::string& host, const std::string& incarnation) {
    absl::MutexLock lock(&mu_);
    std::string& known = incarnation_of_[host];
    if (!known.empty() && known != incarnation) {
      queues_.erase(host);
      queue_failures_->fetch_add(1, std::memory_order_release);  // (see RunGroup)
    }
    known = incarnation;
  }
  // A set of hosts that runs span, the same object for the same hosts in the same order. A run
  // over a group takes the next place in the client's sequence on each of its hosts. While the
  // client puts nothing else on them (no op, no run of another group), the group's runs name
  // only the group, an epoch and the run's number in it (rpc::GangRun.group), and the controller
  // names the hosts: the client's work and message per run do not grow with the hosts. The
  // first run after anything else took a place on one of them starts a new epoch, naming every
  // host with its place; so does the first after a queue of the client's failed anywhere (its
  // replacement starts a new sequence). The mutable fields are guarded by the core's seq_mu_.
  struct RunGroup {
    RunGroup(int64_t id, std::vector<std::string> hosts);
    const int64_t id;
    const std::shared_ptr<const std::vector<std::string>> hosts;
    const std::shared_ptr<const absl::flat_hash_map<std::string, int>> index;
    std::shared_ptr<const RunGroupEpoch> current;  // null before the first run
    int64_t next_run = 0;
    bool dirty = true;  // something else took a place on one of the hosts since `current` began
    int64_t failures_seen = 0;  // the core's queue_failures_ when `current` began
    // The placement whose hosts a run of this group last found all among its own, so that it
    // carries the frees of arrays placed there: checked once per placement, not once per free
    // of each run (a loop frees an array of the same placement at every run). Guarded by the
    // core's free_order_mu_.
    std::weak_ptr<const SliceMapping> covers;
  };
  std::shared_ptr<RunGroup> GroupFor(const std::vector<std::string>& hosts);
  // Sends one run op to the hosts of `group`, to their islands' schedulers through the
  // controller, at the next place of the client's sequence on each. Call with epoch_mu() held, so
  // runs are numbered, sequenced and queued in one order.
  struct PushedRun {
    std::optional<RunPlace> place;        // where it went
    std::map<std::string, SeqRef> seqs;   // instead, under TEST_bypass_scheduler
    Future<Unit> delivered;               // on its hosts, or why it never will be
  };
  PushedRun PushRun(const std::shared_ptr<RunGroup>& group, rpc::RunProgramOp op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(epoch_mu_);
  // The place of the last op of the client's sequence on `host`, runs of groups included.
  SeqRef LastSeq(const std::string& host);
  // Frees array `id`, of `shard_bytes` per shard, on the hosts of `placed_on`. While runs of this
  // client are on their way to the scheduler (a loop `x = f(x)` pipelining), and for kFreeWait
  // after the last is delivered (a loop that waits for each result), a small array's free is
  // held for the next run: when that run reaches every host of the array it carries the id
  // (RunProgramOp.free_array_ids, one id in one message instead of a free op to each host, and
  // nothing that takes a place on the hosts outside the run's group); otherwise, and when no run
  // follows in time, a free op goes to each host. Either way the free takes its place in each
  // host's order before every op pushed after it: Push, PushPut and PushRun place what is held
  // first.
  void Free(ArrayId id, std::shared_ptr<const SliceMapping> placed_on, int64_t shard_bytes);
  // Places the frees held for the next run as ops, if any (and waits for another thread placing
  // some, so that what the caller pushes next comes after them). Also when the Client goes: no
  // run of it will come to carry them.
  void PushHeldFrees() {
    if (frees_unplaced_.load(std::memory_order_acquire) == 0) return;
    absl::MutexLock order(&free_order_mu_);
    std::vector<HeldFree> held;
    {
      absl::MutexLock lock(&free_mu_);
      held = TakeHeldLocked();
    }
    PushFreeOps(held);
    frees_unplaced_.fetch_sub(static_cast<int64_t>(held.size()), std::memory_order_release);
  }
  // A run carries at most this many frees (the rest go as ops): runs stay small messages.
  static constexpr int kMaxFreesPerRun = 1024;
  // What may be held: shards of at most kMaxCarriedShardBytes, at most kMaxHeldBytes of them in
  // all; beyond either, frees go as ops at once. A carried free reaches its hosts only when the
  // scheduler releases the run that carries it, which under proportional share may wait for
  // earlier runs to report done (up to its done timeout), and an earlier run may be waiting for
  // the memory that free returns: so what a client can hold back that way stays small. The
  // per-host ops a free costs matter for small arrays (dispatch-bound loops), not for large ones.
  static constexpr int64_t kMaxCarriedShardBytes = 64 << 10;
  static constexpr int64_t kMaxHeldBytes = 1 << 20;
  // How long frees held when no run is on its way wait for one to carry them.
  static constexpr absl::Duration kFreeWait = absl::Milliseconds(5);

  // OpByOp calls run as one-node programs, traced once per (function, slice).
  absl::StatusOr<Program> OneNodeProgram(const CompiledFunction& function, const VirtualSlice& slice);

  ClientStats stats() const {
    ClientStats stats{ops_sent_.load(), op_bytes_sent_.load(), run_ops_sent_.load(), run_op_bytes_sent_.load(),
                      lowerings_.load(), staged_put_bytes_.load()};
    stats.frees_carried = frees_carried_.load();
    stats.runs_naming_hosts = runs_naming_hosts_.load();
    stats.runs_named_again = runs_named_again_->load();
    const ControllerClient::ScheduleCounts schedules = controller_->schedule_counts();
    stats.schedule_requests_streamed = schedules.streamed;
    stats.schedule_requests_unary = schedules.unary;
    stats.worker_requests_streamed = request_paths_->streamed.load();
    stats.worker_requests_grpc = request_paths_->grpc.load();
    return stats;
  }
  void CountLowering() { lowerings_.fetch_add(1); }

  // Lowered programs by program id and argument placement.
  struct Lowering;
  absl::StatusOr<std::shared_ptr<Lowering>> Lower(const Program& program,
                                                  absl::Span<const ShardedArray> args);

 private:
  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }
  const uint64_t serial_;
  // A run on its way to the controller, and where it went (to name its hosts when the controller
  // does not know its epoch, and to fill its places when it is refused).
  struct QueuedRun {
    rpc::GangRun run;
    RunPlace place;
  };
  std::shared_ptr<OrderedBatchQueue<QueuedRun>> ScheduleQueue();
  // The request for `runs`; with `name_hosts`, the first run of each epoch in it names its hosts
  // (for a controller that did not know the epoch).
  static rpc::ScheduleRequest ScheduleRequestOf(const ClientIdentity& identity, double weight,
                                                const std::vector<QueuedRun>& runs, bool name_hosts);
  // Reserves the next place in the client's sequence on `host` for an op sent later (PushPut's
  // fill), after the places the host's run group took: its queue and the number.
  std::pair<std::shared_ptr<HostOpQueue>, int64_t> ReserveForFill(const std::string& host);
  // The place of the last run of the host's group there, if the host is still in one on `q`.
  std::optional<int64_t> LastGroupRunLocked(const std::string& host, const std::shared_ptr<HostOpQueue>& q)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq_mu_);
  // Gives `run` its place on each host of `group` (see RunGroup), under seq_mu_.
  RunPlace PlaceRun(const std::shared_ptr<RunGroup>& group, rpc::GangRun& run);
  // `host` takes a place outside its run group: its queue counts the group's runs so far, and
  // the group's next run starts a new epoch.
  void LeaveGroupLocked(const std::string& host, const std::shared_ptr<HostOpQueue>& q)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq_mu_);
  void LeaseLoop(absl::Duration interval);
  struct HeldFree {
    ArrayId id;
    std::shared_ptr<const SliceMapping> placed_on;
    int64_t shard_bytes = 0;
  };
  void PushFreeOp(const std::string& host, int64_t id);
  // A free op for each array to each of its hosts.
  void PushFreeOps(const std::vector<HeldFree>& frees);

  std::vector<HeldFree> TakeHeldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(free_mu_) {
    std::vector<HeldFree> held;
    held.swap(held_frees_);
    held_bytes_ = 0;
    return held;
  }

  const ClientIdentity identity_;
  const ClientOptions options_;
  std::shared_ptr<ControllerClient> controller_;  // shared with calls in flight
  // How this client's op batches and fetches went to workers; shared with requests in flight.
  const std::shared_ptr<RequestPaths> request_paths_ = std::make_shared<RequestPaths>();
  absl::Notification lease_stop_;
  std::thread lease_thread_;
  IdGenerator<ArrayId> array_ids_;
  IdGenerator<RunId> run_ids_;
  IdGenerator<Epoch> epochs_;
  IdGenerator<LoweredProgramId> lowered_program_ids_;
  IdGenerator<MappingId> mapping_ids_;
  absl::Mutex epoch_mu_;
  std::atomic<int64_t> ops_sent_{0}, op_bytes_sent_{0}, run_ops_sent_{0}, run_op_bytes_sent_{0}, lowerings_{0},
      staged_put_bytes_{0}, frees_carried_{0}, runs_naming_hosts_{0};
  // Frees held for the next run (see Free), while runs pushed through the scheduler are not all
  // delivered yet. free_order_mu_ is held from taking held frees until they have their places on
  // the hosts (as ops, or with the run that carries them), so that nothing pushed meanwhile
  // takes a place before them.
  absl::Mutex free_order_mu_ ABSL_ACQUIRED_BEFORE(free_mu_);
  absl::Mutex free_mu_;
  int64_t runs_undelivered_ ABSL_GUARDED_BY(free_mu_) = 0;
  // When the last run was delivered, and whether a check that sends held frees kFreeWait after
  // it is pending: one check for the client, moved on as runs keep coming, not one timer per
  // run (each a wake-up of the timer thread, ~10 us of CPU per call on a VM).
  absl::Time last_delivery_ ABSL_GUARDED_BY(free_mu_);
  bool free_check_pending_ ABSL_GUARDED_BY(free_mu_) = false;
  // Sends what is held once kFreeWait has passed since the last delivery with no run on its
  // way; otherwise looks again when that time comes (or leaves it to the next delivery).
  void CheckHeldFrees();
  std::vector<HeldFree> held_frees_ ABSL_GUARDED_BY(free_mu_);
  int64_t held_bytes_ ABSL_GUARDED_BY(free_mu_) = 0;
  std::atomic<int64_t> frees_unplaced_{0};  // held, or taken and not yet given their places
  // Shared with the schedule queue's sender (which may outlive the core).
  const std::shared_ptr<std::atomic<int64_t>> runs_named_again_ = std::make_shared<std::atomic<int64_t>>(0);
  // Batches any of the client's host queues failed, and queues dropped for a host that restarted:
  // a run group's next run then starts a new epoch (a replaced queue starts a new sequence).
  const std::shared_ptr<std::atomic<int64_t>> queue_failures_ = std::make_shared<std::atomic<int64_t>>(0);
  // Orders numbering in the client's sequences: ops to hosts and runs of groups (taken after
  // free_order_mu_ and before mu_).
  absl::Mutex seq_mu_;
  absl::flat_hash_map<std::vector<std::string>, std::shared_ptr<RunGroup>> groups_ ABSL_GUARDED_BY(seq_mu_);
  int64_t last_group_id_ ABSL_GUARDED_BY(seq_mu_) = 0;
  // The group each host took its last place with, and the queue it took it on.
  struct Membership {
    std::shared_ptr<RunGroup> group;
    std::shared_ptr<HostOpQueue> queue;
  };
  absl::flat_hash_map<std::string, Membership> members_ ABSL_GUARDED_BY(seq_mu_);
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<HostOpQueue>> queues_ ABSL_GUARDED_BY(mu_);
  // Why sequences to each host broke, by session (see BreakOf): the last few.
  static constexpr size_t kBreaksKept = 8;
  absl::flat_hash_map<std::string, std::map<int64_t, absl::Status>> breaks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, LogLimiter> break_log_ ABSL_GUARDED_BY(mu_);  // by host address
  LogLimiter refused_log_ ABSL_GUARDED_BY(mu_){absl::Minutes(1)};                // runs the scheduler refused
  absl::flat_hash_map<std::string, std::string> incarnation_of_ ABSL_GUARDED_BY(mu_);
  // One queue for all islands: the controller sees the client's runs in the client's order.
  std::shared_ptr<OrderedBatchQueue<QueuedRun>> schedule_queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Lowering>> lowerings_cache_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<const void*, SliceId>, Program> one_node_programs_ ABSL_GUARDED_BY(mu_);
};

struct CompiledFunction::State {
  FunctionSpec spec;
  std::string key;
  uint64_t owner;  // the ClientCore's serial()
  absl::Mutex mu;
  absl::flat_hash_set<std::string> compiled_on ABSL_GUARDED_BY(mu);  // ClientCore::HostKey of each host
};

struct ShardedArray::State {
  State(std::shared_ptr<ClientCore> core, ArrayId id, TensorSpec spec, Sharding sharding, VirtualSlice slice,
        std::shared_ptr<const SliceMapping> placed_on)
      : core(std::move(core)),
        id(id),
        spec(std::move(spec)),
        sharding(std::move(sharding)),
        slice(std::move(slice)),
        placed_on(std::move(placed_on)) {}
  // One State per logical array: a copy would free the array twice.
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  std::shared_ptr<ClientCore> core;
  ArrayId id;
  TensorSpec spec;
  Sharding sharding;
  VirtualSlice slice;
  // The slice's mapping when the array was placed: its shards stay there if the slice is remapped.
  std::shared_ptr<const SliceMapping> placed_on;
  // Ready once the op producing the array has been pushed to its hosts' queues. Immediate except
  // under sequential dispatch, where a run's later nodes are pushed as earlier ones are enqueued.
  Future<Unit> dispatched = Future<Unit>::Ready(Unit{});
  // Ready once that op has reached its hosts, or failed with why it never will (the island
  // scheduler refused it: a host left, say). Immediate for Put.
  Future<Unit> delivered = Future<Unit>::Ready(Unit{});
  // Per host, the place of the op that produces the array there: a fetch asks the host to wait
  // for that op, not for everything sent since. A put's, by host; a run's, as the places of its
  // segments' runs (the last that spans a host). Complete once `dispatched` is ready.
  std::shared_ptr<std::map<std::string, SeqRef>> produced_at = std::make_shared<std::map<std::string, SeqRef>>();
  std::shared_ptr<std::vector<RunPlace>> run_places;
  std::optional<SeqRef> ProducedOn(const std::string& host) const {
    if (run_places != nullptr) {
      for (auto it = run_places->rbegin(); it != run_places->rend(); ++it) {
        if (std::optional<SeqRef> at = it->On(host)) return at;
      }
    }
    auto at = produced_at->find(host);
    if (at == produced_at->end()) return std::nullopt;
    return at->second;
  }
  // False for a run's intermediates, which the hosts free themselves.
  bool owned = true;
  // Set once the array is given to a call at a donated position: the handle is spent.
  mutable std::atomic<bool> donated{false};
  // Fetches and Ready waits in flight: a call that the array is donated to waits for them first,
  // so that they see the array as it was.
  void TrackRead(Future<Unit> read) const;
  void AwaitReads() const;
  mutable absl::Mutex reads_mu;
  mutable std::vector<Future<Unit>> reads ABSL_GUARDED_BY(reads_mu);

  // Freeing goes through each host's ordered queue, behind every op that still reads the array
  // and before every op pushed after (ClientCore::Free).
  ~State();
};

struct ClientCore::Lowering {
  LoweredProgramId id;             // the program id hosts know this lowering by
  rpc::ProgramProto proto;
  std::vector<std::string> hosts;  // every host that runs, holds or sends anything in it
  std::vector<std::vector<std::string>> node_hosts;  // per node: its slice's and its inputs' hosts
  int64_t num_outputs = 0;
  std::vector<int64_t> output_offsets;              // per node
  std::vector<std::vector<Sharding>> out_shardings;  // per node and output
  std::vector<std::shared_ptr<const SliceMapping>> node_mappings;  // per node: its slice's mapping when lowered
  // The ops a run is pushed as: nodes first..last, over the hosts of `group` (those that run,
  // hold or send anything for the nodes); after a node with data-dependent shapes the next op
  // waits until it is computed.
  struct Segment {
    int first;
    int last;
    bool wait_until_computed;
    std::shared_ptr<RunGroup> group;
  };
  absl::Mutex mu;
  // Per dispatch: [0] parallel (one op unless a node has data-dependent shapes), [1] sequential
  // (an op per node). Made on first use.
  std::vector<Segment> segments[2] ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<std::string> registered_on ABSL_GUARDED_BY(mu);
  std::atomic<bool> ready{false};  // compiled and registered on every host
};

// Completes when every shard of the array is computed (fetch.cc). Assumes the producing op was
// pushed.
Future<Unit> ShardsReady(const std::shared_ptr<ClientCore>& core,
                         const std::shared_ptr<const ShardedArray::State>& state);

}  // namespace pathways
