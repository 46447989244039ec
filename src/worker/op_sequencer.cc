#include "worker/op_sequencer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"

namespace pathways {
namespace {
// Bounds what a client can park here with sequence numbers far ahead of its real ones.
constexpr size_t kMaxWaitingOpsPerClient = 1 << 20;
constexpr size_t kMaxRememberedDropped = 1 << 16;
}  // namespace

OpSequencer::OpSequencer(ApplyFn apply, RetireFn retire, absl::Duration gap_timeout, Limits limits, SkipFn skipped)
    : apply_(std::move(apply)),
      retire_(std::move(retire)),
      skipped_(std::move(skipped)),
      gap_timeout_(gap_timeout),
      limits_(limits),
      watchdog_([this] {
        NameThisThread("op-gaps");
        WatchGaps();
      }) {}

OpSequencer::~OpSequencer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  watchdog_.join();
}

void OpSequencer::Settle(Settlements& settle) {
  for (auto& [promise, status] : settle) {
    if (status.ok()) {
      promise.Set(Unit{});
    } else {
      promise.Set(status);
    }
  }
}

absl::Status OpSequencer::AddDirect(const std::string& client, std::vector<rpc::Op> ops) {
  Settlements settle;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (auto gone = dropped_.find(client); gone != dropped_.end()) return gone->second;
    // A batch is one session's (its queue stamps them all alike).
    const int64_t session = ops.empty() ? 0 : ops.front().session();
    ClientState& c = clients_[{client, session}];
    for (rpc::Op& op : ops) {
      const int64_t seq = op.seq();
      if (op.session() != session) {
        status = absl::InvalidArgumentError("ops of one batch belong to different sessions");
        continue;
      }
      if (seq <= c.applied || c.waiting.contains(seq)) {
        // A skip fills a number the client reserved for a run the scheduler refused; when the
        // run reached this host anyway (it was refused because another host of its gang left),
        // the number is already filled and the skip is moot.
        if (op.has_skip()) continue;
        status = absl::InvalidArgumentError(absl::StrCat("op sequence number ", seq, " of client ", client,
                                                         " is not new (applied up to ", c.applied, ")"));
        continue;
      }
      size_t charged = 0;
      if (seq != c.applied + 1) {  // it waits: within the limits
        const size_t bytes = op.ByteSizeLong();
        const size_t client_bytes = waiting_bytes_.contains(client) ? waiting_bytes_[client] : 0;
        if (c.waiting.size() >= kMaxWaitingOpsPerClient || client_bytes + bytes > limits_.waiting_bytes_per_client ||
            total_waiting_bytes_ + bytes > limits_.waiting_bytes) {
          status = absl::ResourceExhaustedError(absl::StrCat(
              "op ", seq, " of client ", client, " (", bytes, " bytes) would wait for earlier ones, and this host ",
              "already holds ", c.waiting.size(), " such ops of this session, ", client_bytes, " bytes for the client, ",
              total_waiting_bytes_, " for all clients (at most ", kMaxWaitingOpsPerClient, " ops, ",
              limits_.waiting_bytes_per_client, " and ", limits_.waiting_bytes,
              " bytes): send fewer ops ahead of the runs they follow"));
          continue;
        }
        charged = bytes;
        waiting_bytes_[client] += bytes;
        total_waiting_bytes_ += bytes;
        c.waiting_bytes += bytes;
      }
      c.waiting.emplace(seq, std::make_pair(std::move(op), charged));
      AdvanceLocked(client, c, settle);  // an op next in sequence is applied at once, never held
    }
    DrainLocked(settle);
  }
  Settle(settle);
  return status;
}

absl::Status OpSequencer::AddScheduled(std::vector<rpc::ScheduledOp> ops) {
  Settlements settle;
  {
    absl::MutexLock lock(&mu_);
    for (rpc::ScheduledOp& op : ops) {
      if (!dropped_.contains(op.client_id())) scheduled_.push_back(std::move(op));
    }
    DrainLocked(settle);
  }
  Settle(settle);
  return absl::OkStatus();
}

Future<Unit> OpSequencer::WhenApplied(const std::string& client, int64_t session, int64_t seq) {
  absl::MutexLock lock(&mu_);
  if (auto gone = dropped_.find(client); gone != dropped_.end()) return Future<Unit>::Ready(gone->second);
  if (!failed_.ok()) return Future<Unit>::Ready(failed_);
  ClientState& c = clients_[{client, session}];
  if (seq <= c.applied) return Future<Unit>::Ready(Unit{});
  Promise<Unit> p;
  Future<Unit> f = p.future();
  c.waiters.emplace(seq, std::move(p));
  return f;
}

std::vector<std::string> OpSequencer::Clients() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> clients;
  for (const auto& [key, state] : clients_) clients.push_back(key.first);
  return clients;
}

void OpSequencer::FailWaiters(const absl::Status& why) {
  Settlements settle;
  {
    absl::MutexLock lock(&mu_);
    failed_ = why;
    for (auto& [key, c] : clients_) {
      for (auto& [seq, p] : c.waiters) settle.emplace_back(std::move(p), why);
      c.waiters.clear();
    }
  }
  Settle(settle);
}

void OpSequencer::DropClientLocked(const std::string& client, Settlements& settle) {
  const absl::Status why = absl::FailedPreconditionError(absl::StrCat("client ", client, " went away"));
  if (dropped_.emplace(client, why).second) dropped_order_.push_back(client);
  while (dropped_order_.size() > kMaxRememberedDropped) {
    dropped_.erase(dropped_order_.front());
    dropped_order_.pop_front();
  }
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (it->first.first != client) {
      ++it;
      continue;
    }
    for (auto& [seq, p] : it->second.waiters) settle.emplace_back(std::move(p), why);
    total_waiting_bytes_ -= it->second.waiting_bytes;
    clients_.erase(it++);
  }
  waiting_bytes_.erase(client);
}

rpc::Op OpSequencer::TakeFirstWaitingLocked(const std::string& client, ClientState& c) {
  auto it = c.waiting.begin();
  auto [op, charged] = std::move(it->second);
  c.waiting.erase(it);
  if (charged > 0) {
    c.waiting_bytes -= charged;
    total_waiting_bytes_ -= charged;
    auto counted = waiting_bytes_.find(client);
    if ((counted->second -= charged) == 0) waiting_bytes_.erase(counted);
  }
  return op;
}

void OpSequencer::AdvanceLocked(const std::string& client, ClientState& c, Settlements& settle) {
  while (!c.waiting.empty()) {
    auto it = c.waiting.begin();
    if (it->first <= c.applied) {  // skipped over by the gap watchdog
      TakeFirstWaitingLocked(client, c);
      continue;
    }
    if (it->first != c.applied + 1) break;
    rpc::Op op = TakeFirstWaitingLocked(client, c);
    c.applied = op.seq();
    apply_(client, op);
  }
  while (!c.waiters.empty() && c.waiters.begin()->first <= c.applied) {
    settle.emplace_back(std::move(c.waiters.begin()->second), absl::OkStatus());
    c.waiters.erase(c.waiters.begin());
  }
}

void OpSequencer::DrainLocked(Settlements& settle) {
  while (!scheduled_.empty()) {
    rpc::ScheduledOp& head = scheduled_.front();
    if (head.retire_client()) {
      const std::string client = head.client_id();
      scheduled_.pop_front();
      DropClientLocked(client, settle);
      retire_(client);
      continue;
    }
    ClientState& c = clients_[{head.client_id(), head.op().session()}];
    const int64_t seq = head.op().seq();
    if (seq > c.applied + 1) {
      // An earlier op of its client is still on its way, unless the client's retirement is queued
      // behind: it went away, so what it had not sent will not come, and waiting out the gap
      // timeout would only hold the island (and the freeing of its buffers) back.
      const bool retired = std::any_of(scheduled_.begin() + 1, scheduled_.end(), [&](const rpc::ScheduledOp& op) {
        return op.retire_client() && op.client_id() == head.client_id();
      });
      if (!retired) {
        if (head_blocked_since_ == absl::InfiniteFuture()) head_blocked_since_ = absl::Now();
        return;
      }
      PW_LOG(Warning) << "client " << head.client_id() << " went away before sending ops " << c.applied + 1 << ".."
                      << seq - 1 << "; its scheduled run goes ahead without them";
      c.applied = seq - 1;
    }
    head_blocked_since_ = absl::InfiniteFuture();
    if (seq <= c.applied) {
      PW_LOG(Error) << "scheduled op " << seq << " of client " << head.client_id() << " is not new; dropped";
    } else {
      c.applied = seq;
      apply_(head.client_id(), head.op());
    }
    const std::string client = head.client_id();
    scheduled_.pop_front();
    AdvanceLocked(client, c, settle);
  }
}

void OpSequencer::WatchGaps() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), std::min(gap_timeout_, absl::Seconds(1)));
    if (stop_ || scheduled_.empty() || absl::Now() - head_blocked_since_ < gap_timeout_) continue;
    rpc::ScheduledOp& head = scheduled_.front();
    ClientState& c = clients_[{head.client_id(), head.op().session()}];
    const absl::Status why = absl::DeadlineExceededError(
        absl::StrCat("ops ", c.applied + 1, "..", head.op().seq() - 1, " of session ", head.op().session(),
                     " never came within ", absl::FormatDuration(gap_timeout_),
                     " and were skipped; its scheduled run went ahead without them"));
    PW_LOG(Error) << "client " << head.client_id() << ": " << why.message();
    if (skipped_) skipped_(head.client_id(), why);
    c.applied = head.op().seq() - 1;
    Settlements settle;
    AdvanceLocked(head.client_id(), c, settle);
    DrainLocked(settle);
    mu_.Unlock();
    Settle(settle);
    mu_.Lock();
  }
}

}  // namespace pathways
