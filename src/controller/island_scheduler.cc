#include "controller/island_scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"

namespace pathways {
namespace {
constexpr size_t kMaxQueuedPerClient = 256;
}  // namespace

IslandScheduler::IslandScheduler(int island, IslandSchedulerOptions options, ScheduledOpSink& sink)
    : island_(island), options_(options), sink_(sink) {
  if (options_.policy == SchedulingPolicy::kProportionalShare) {
    expirer_ = std::thread([this] {
      NameThisThread("share-expire");
      ExpireLoop();
    });
  }
}

IslandScheduler::~IslandScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (expirer_.joinable()) expirer_.join();
}

void IslandScheduler::ExpireLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), std::min(options_.done_timeout / 4, absl::Milliseconds(100)));
    const absl::Time now = absl::Now();
    bool expired = false;
    for (auto it = outstanding_.begin(); it != outstanding_.end();) {
      if (now - it->second.released < options_.done_timeout) {
        ++it;
        continue;
      }
      PW_LOG(Warning) << "island " << island_ << ": run " << it->first.second << " of client " << it->first.first
                      << " not reported done within " << absl::FormatDuration(options_.done_timeout);
      outstanding_us_ -= it->second.estimate_us;
      it = outstanding_.erase(it);
      expired = true;
    }
    if (!expired) continue;
    if (outstanding_.empty()) outstanding_us_ = 0;
    Sent sent;
    Reached reached;
    ReleaseLocked(sent, reached);
    sink_.EndRound();
    mu_.Unlock();
    Wire(std::move(sent));
    Report(std::move(reached));
    mu_.Lock();
  }
}

Future<Unit> IslandScheduler::Submit(const std::string& client, double weight, std::vector<rpc::GangRun> runs,
                                     std::shared_ptr<CrossIslandRun> across) {
  std::vector<Future<Unit>> accepted;
  Sent sent;
  Reached reached;
  {
    absl::MutexLock lock(&mu_);
    auto [it, is_new] = clients_.try_emplace(client);
    ClientQueue& q = it->second;
    if (is_new) {
      // Until its own runs are measured, a client's runs are guessed to cost what others' do.
      double sum = 0;
      int n = 0;
      for (const auto& [id, other] : clients_) {
        if (!other.measured) continue;
        sum += other.estimate_us;
        ++n;
      }
      if (n > 0) q.estimate_us = sum / n;
    }
    q.weight = weight > 0 ? weight : 1;
    for (rpc::GangRun& run : runs) {
      Pending p{std::move(run), {}, across};
      accepted.push_back(p.accepted.future());
      // Under proportional share a client's runs wait here by design; the client hears they are
      // taken once queued, so it keeps the scheduler supplied, up to a bound per client beyond
      // which it hears only as they go out (backpressure).
      if (options_.policy == SchedulingPolicy::kProportionalShare && q.pending.size() < kMaxQueuedPerClient) {
        p.accepted.Set(Unit{});
      }
      q.pending.push_back(std::move(p));
    }
    ReleaseLocked(sent, reached);
    sink_.EndRound();
  }
  Wire(std::move(sent));
  Report(std::move(reached));
  return AllDone(accepted);
}

void IslandScheduler::RetireClient(const std::string& client, const std::vector<std::string>& hosts) {
  std::vector<Promise<Unit>> dropped;
  std::vector<std::shared_ptr<CrossIslandRun>> across;  // their parts elsewhere are dropped too
  {
    absl::MutexLock lock(&mu_);
    if (auto it = clients_.find(client); it != clients_.end()) {
      for (Pending& p : it->second.pending) {
        dropped.push_back(std::move(p.accepted));
        if (p.across != nullptr) across.push_back(p.across);
      }
      if (it->second.holding != nullptr) across.push_back(it->second.holding);
      clients_.erase(it);
    }
    for (const std::string& host : hosts) {
      rpc::ScheduledOp op;
      op.set_client_id(client);
      op.set_retire_client(true);
      (void)sink_.Push(host, std::move(op));
    }
    sink_.EndRound();
  }
  const absl::Status gone = absl::CancelledError(absl::StrCat("client ", client, " went away"));
  for (auto& run : across) run->Cancel(gone);
  for (auto& p : dropped) p.Set(gone);
}

void IslandScheduler::Done(const std::string& client, int64_t epoch, int64_t device_us) {
  Sent sent;
  Reached reached;
  {
    absl::MutexLock lock(&mu_);
    auto it = outstanding_.find({client, epoch});
    if (it == outstanding_.end()) return;
    Outstanding& o = it->second;
    o.max_device_us = std::max(o.max_device_us, device_us);
    if (--o.hosts_left > 0) return;
    // The run's cost is what its busiest device spent on it; recent runs weigh most, and the
    // first measurement replaces the guess. (A client retired meanwhile has no queue left.)
    if (auto q = clients_.find(o.client); q != clients_.end()) {
      const double cost = static_cast<double>(std::max<int64_t>(o.max_device_us, 1));
      q->second.estimate_us = q->second.measured ? 0.7 * q->second.estimate_us + 0.3 * cost : cost;
      q->second.measured = true;
    }
    outstanding_us_ -= o.estimate_us;
    outstanding_.erase(it);
    if (outstanding_.empty()) outstanding_us_ = 0;  // no drift from rounding
    ReleaseLocked(sent, reached);
    sink_.EndRound();
  }
  Wire(std::move(sent));
  Report(std::move(reached));
}

std::vector<Future<Unit>> IslandScheduler::SendLocked(const std::string& client, const rpc::GangRun& run,
                                                      bool report_done) {
  std::vector<Future<Unit>> acks;
  for (const rpc::HostSeq& h : run.hosts()) {
    rpc::ScheduledOp op;
    op.set_client_id(client);
    *op.mutable_op()->mutable_run() = run.run();
    op.mutable_op()->mutable_run()->set_report_done(report_done);
    op.mutable_op()->set_seq(h.seq());
    op.mutable_op()->set_session(h.session());
    acks.push_back(sink_.Push(h.host(), std::move(op)));
  }
  return acks;
}

void IslandScheduler::ReleaseLocked(Sent& sent, Reached& reached) {
  if (options_.policy == SchedulingPolicy::kFifo) {
    // Submissions are serialised by mu_, so arrival order is one order for every host.
    for (auto& [id, q] : clients_) {
      while (!q.pending.empty() && q.holding == nullptr) {
        Pending p = std::move(q.pending.front());
        q.pending.pop_front();
        NoteReleasedLocked(q, p);
        if (p.across != nullptr) {
          q.holding = p.across;
          reached.emplace_back(id, std::move(p));
        } else {
          sent.emplace_back(std::move(p.accepted), SendLocked(id, p.run, false));
        }
      }
    }
    return;
  }
  const double window_us = static_cast<double>(absl::ToInt64Microseconds(options_.window));
  while (outstanding_.empty() || outstanding_us_ < window_us) {
    // The backlogged client whose next run starts earliest in virtual time.
    ClientQueue* next = nullptr;
    const std::string* next_id = nullptr;
    double next_start = 0;
    for (auto& [id, q] : clients_) {
      if (q.pending.empty() || q.holding != nullptr) continue;
      const double start = std::max(virtual_time_, q.finish);
      if (next == nullptr || start < next_start || (start == next_start && id < *next_id)) {
        next = &q;
        next_id = &id;
        next_start = start;
      }
    }
    if (next == nullptr) return;
    Pending p = std::move(next->pending.front());
    next->pending.pop_front();
    NoteReleasedLocked(*next, p);
    virtual_time_ = next_start;
    next->finish = next_start + next->estimate_us / next->weight;
    if (p.across != nullptr) {
      // Its share is spent now; it counts against the window once it goes out (a held part
      // filling the window could keep this island from reaching the part another island holds).
      next->holding = p.across;
      reached.emplace_back(*next_id, std::move(p));
    } else {
      OutstandingLocked(*next_id, p.run);
      sent.emplace_back(std::move(p.accepted), SendLocked(*next_id, p.run, true));
    }
  }
}

void IslandScheduler::NoteReleasedLocked(ClientQueue& q, const Pending& p) {
  ++q.released;
  ++released_;
  const int64_t wait_us = std::max<int64_t>(0, absl::ToInt64Microseconds(absl::Now() - p.submitted));
  release_wait_us_ += wait_us;
  size_t bucket = 0;
  while (bucket + 1 < kReleaseWaitBuckets && static_cast<double>(wait_us) > kReleaseWaitBoundsUs[bucket]) ++bucket;
  ++release_wait_buckets_[bucket];
}

rpc::SchedulerStatus IslandScheduler::Status() const {
  absl::MutexLock lock(&mu_);
  rpc::SchedulerStatus status;
  status.set_island(island_);
  status.set_policy(options_.policy == SchedulingPolicy::kFifo ? "fifo" : "proportional-share");
  status.set_released_runs(released_);
  status.set_release_wait_us_sum(release_wait_us_);
  status.set_outstanding_runs(static_cast<int64_t>(outstanding_.size()));
  for (double bound : kReleaseWaitBoundsUs) status.add_release_wait_bounds_us(bound);
  for (int64_t n : release_wait_buckets_) status.add_release_wait_buckets(n);
  std::map<std::string, const ClientQueue*> sorted;  // a stable order for pages and tests
  for (const auto& [id, q] : clients_) sorted[id] = &q;
  for (const auto& [id, q] : sorted) {
    rpc::SchedulerClientStatus* c = status.add_clients();
    c->set_client_id(id);
    c->set_weight(q->weight);
    c->set_queued_runs(static_cast<int64_t>(q->pending.size()));
    c->set_released_runs(q->released);
    c->set_estimate_us(q->estimate_us);
  }
  return status;
}

void IslandScheduler::OutstandingLocked(const std::string& client, const rpc::GangRun& run) {
  auto q = clients_.find(client);
  const double estimate = q == clients_.end() ? 100 : q->second.estimate_us;
  outstanding_[{client, run.run().epoch()}] = {client, run.hosts_size(), 0, estimate, absl::Now()};
  outstanding_us_ += estimate;
}

void IslandScheduler::Report(Reached reached) {
  for (auto& [client, p] : reached) {
    // Either sent once every island reached its part, or cancelled if the client went away
    // first.
    auto accepted = std::make_shared<Promise<Unit>>(std::move(p.accepted));
    p.across->Reached([this, client = client, run = std::move(p.run), accepted] { SendPart(client, run, accepted); },
                      [accepted](absl::Status why) { accepted->Set(std::move(why)); });
  }
}

void IslandScheduler::SendPart(const std::string& client, const rpc::GangRun& run,
                               std::shared_ptr<Promise<Unit>> accepted) {
  Sent sent;
  Reached reached;
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(client);
    if (it == clients_.end()) {
      // Retired since every island reached the run: its hosts collect the client at the point
      // the retirement reached them, and a run after it must not follow.
      accepted->Set(absl::CancelledError(absl::StrCat("client ", client, " went away")));
      return;
    }
    it->second.holding = nullptr;
    const bool share = options_.policy == SchedulingPolicy::kProportionalShare;
    if (share) OutstandingLocked(client, run);
    sent.emplace_back(std::move(*accepted), SendLocked(client, run, share));
    ReleaseLocked(sent, reached);
    sink_.EndRound();
  }
  Wire(std::move(sent));
  Report(std::move(reached));
}

void IslandScheduler::Wire(Sent sent) {
  for (auto& [promise, acks] : sent) {
    AllDone(acks).OnReady([p = std::move(promise)](const absl::StatusOr<Unit>& r) mutable { p.Set(r); });
  }
}

}  // namespace pathways
