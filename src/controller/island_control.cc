#include "controller/island_control.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "dataflow/control_graph.h"

namespace pathways {

using L = dataflow::ControlGraphLayout;

// `accepted`: one shard per host, which finishes a round once that host's apply shard has all of
// it; the round is over once every host it had ops for has.
class IslandControlPlane::Accepted : public dataflow::Operator {
 public:
  Accepted(IslandControlPlane& plane, int64_t generation) : plane_(plane), generation_(generation) {}
  void OnMessage(dataflow::ShardContext&, int, int, const std::string&) override {}
  void OnEpochDone(dataflow::ShardContext& ctx) override {
    plane_.HostAccepted(generation_, ctx.epoch(), ctx.shard());
  }

 private:
  IslandControlPlane& plane_;
  const int64_t generation_;
};

// `done`: one shard per host, taking that host's reports.
class IslandControlPlane::Done : public dataflow::Operator {
 public:
  explicit Done(IslandControlPlane& plane) : plane_(plane) {}
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override {
    rpc::RunDone done;
    if (!done.ParseFromString(payload)) {
      PW_LOG(Error) << "island " << plane_.options_.island << ": unreadable report from host shard " << ctx.shard();
      return;
    }
    if (plane_.options_.on_done) plane_.options_.on_done(done);
  }
  void OnEpochDone(dataflow::ShardContext&) override {}

 private:
  IslandControlPlane& plane_;
};

namespace {

// The schedule shard passes each op to the apply shard of its host.
class Schedule : public dataflow::Operator {
 public:
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override {
    auto decoded = dataflow::DecodeScheduled(payload);
    if (!decoded.ok()) return;  // encoded here, so never
    ctx.Send(L::kToHosts, decoded->first, std::move(decoded->second));
  }
  void OnEpochDone(dataflow::ShardContext&) override {}
};

}  // namespace

IslandControlPlane::IslandControlPlane(IslandControlOptions options) : options_(std::move(options)) {}

IslandControlPlane::~IslandControlPlane() {
  Stop();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [number, g] : generations_) options_.service->RemoveEngine(g->engine->graph().name());
    generations_.clear();
  }
  engines_.ShutdownAll();  // batches still queued hold them; their operators refer to this plane
}

void IslandControlPlane::Stop() {
  std::vector<Promise<Unit>> failed;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    for (auto& [number, g] : generations_) {
      for (auto& [round, r] : g->pending) {
        if (!r.settled) failed.push_back(std::move(r.accepted));
      }
      g->pending.clear();
    }
  }
  for (auto& p : failed) p.Set(absl::UnavailableError("the controller is shutting down"));
}

int64_t IslandControlPlane::rounds() const {
  absl::MutexLock lock(&mu_);
  return round_ - 1;
}

int64_t IslandControlPlane::generation() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

IslandControlPlane::Generation* IslandControlPlane::CurrentLocked() {
  auto it = generations_.find(current_);
  return it == generations_.end() ? nullptr : it->second.get();
}

void IslandControlPlane::SetMembers(std::vector<Member> members) {
  std::sort(members.begin(), members.end());
  std::vector<std::pair<Promise<Unit>, absl::StatusOr<Unit>>> settle;
  std::vector<std::pair<std::string, rpc::ControlGraph>> joins;
  {
    absl::MutexLock lock(&mu_);
    if (members == members_) return;
    CloseRoundLocked();  // the open round goes to the hosts it was meant for
    std::set<std::string> left;
    for (const Member& m : members_) {
      if (!std::binary_search(members.begin(), members.end(), m)) left.insert(m.address);
    }
    if (!left.empty()) {
      // Rounds that a host which left had not accepted fail now. A round stays pending, though,
      // until every host still here that it carried ops for has accepted it: those ops may still
      // be on their way, and their generation must stay in use (the new generation names it as
      // the oldest, so hosts keep it) until they arrive. Dropped, they would leave a gap in those
      // hosts' orders that nothing fills: every later op there would wait for good.
      for (auto& [number, g] : generations_) {
        for (auto it = g->pending.begin(); it != g->pending.end();) {
          Round& r = it->second;
          std::string gone;
          for (auto h = r.hosts.begin(); h != r.hosts.end();) {
            if (!left.contains(*h)) {
              ++h;
              continue;
            }
            gone = *h;
            h = r.hosts.erase(h);
          }
          if (!gone.empty() && !r.settled) {
            settle.emplace_back(std::move(r.accepted),
                                absl::UnavailableError(absl::StrCat("host ", gone, " left island ", options_.island,
                                                                    " before taking scheduling round ", it->first)));
            r.settled = true;
          }
          it = r.hosts.empty() ? g->pending.erase(it) : std::next(it);
        }
      }
    }
    members_ = members;
    current_ = 0;
    for (const Member& m : members_) {
      auto& order = orders_[m.address];
      if (order.first != m.incarnation) order = {m.incarnation, 0};  // a new process counts from 1
    }
    if (!members_.empty()) {
      auto g = std::make_unique<Generation>();
      g->def.set_island(options_.island);
      g->def.set_generation(next_generation_++);
      g->def.set_controller(options_.controller);
      g->def.set_controller_incarnation(options_.controller_incarnation);
      for (const Member& m : members_) {
        g->shard_of[m.address] = g->def.hosts_size();
        g->def.add_hosts(m.address);
      }
      DropIdleLocked();  // before naming the oldest generation still used
      g->def.set_oldest_generation(generations_.empty() ? g->def.generation() : generations_.begin()->first);
      auto graph = dataflow::MakeControlGraph(g->def);
      if (!graph.ok()) {
        PW_LOG(Error) << "island " << options_.island << ": no control graph: " << graph.status();
      } else {
        const int64_t number = g->def.generation();
        g->engine = std::make_shared<dataflow::Engine>(
            options_.controller, *std::move(graph),
            [this, number](int node, int) -> std::unique_ptr<dataflow::Operator> {
              if (node == L::kSchedule) return std::make_unique<Schedule>();
              if (node == L::kAccepted) return std::make_unique<Accepted>(*this, number);
              return std::make_unique<Done>(*this);
            },
            *options_.transport, *options_.executor);
        // Its operators settle rounds and reports and send, never waiting: batches are handled as
        // they are read.
        g->engine->set_handles_on_arrival(true);
        // A new generation's graph name is new: nothing can have been held or lost for it.
        (void)options_.service->AddEngine(g->engine.get());
        engines_.Add(g->engine);
        for (const Member& m : members_) joins.emplace_back(m.address, g->def);
        PW_LOG(Info) << "island " << options_.island << ": control generation " << number << " over "
                     << members_.size() << " hosts";
        generations_[number] = std::move(g);
        current_ = number;
      }
    }
    DropIdleLocked();
  }
  for (auto& [promise, result] : settle) promise.Set(std::move(result));
  for (auto& [host, def] : joins) {
    options_.join(host, def).OnReady([host = host, island = options_.island](const absl::StatusOr<Unit>& r) {
      if (!r.ok()) PW_LOG(Warning) << "island " << island << ": host " << host << " did not join its control graph: " << r.status();
    });
  }
}

Future<Unit> IslandControlPlane::Push(const std::string& host, rpc::ScheduledOp op) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return Future<Unit>::Ready(absl::UnavailableError("the controller is shutting down"));
  Generation* g = CurrentLocked();
  auto shard = g == nullptr ? std::map<std::string, int32_t>::iterator() : g->shard_of.find(host);
  if (g == nullptr || shard == g->shard_of.end()) {
    return Future<Unit>::Ready(absl::UnavailableError(
        absl::StrCat("host ", host, " is not a live host of island ", options_.island)));
  }
  op.set_order(++orders_[host].second);
  open_.push_back(dataflow::EncodeScheduled(shard->second, op));
  Round& r = g->pending[round_];
  r.hosts.insert(host);
  return r.accepted.future();
}

void IslandControlPlane::EndRound() {
  absl::MutexLock lock(&mu_);
  CloseRoundLocked();
}

void IslandControlPlane::CloseRoundLocked() {
  Generation* g = CurrentLocked();
  if (open_.empty() || g == nullptr) return;
  const int64_t round = round_++;
  absl::Status s = g->engine->InjectAll(L::kSchedule, 0, round, std::move(open_));
  open_.clear();
  if (!s.ok()) PW_LOG(Error) << "island " << options_.island << ": round " << round << " not sent: " << s;
}

void IslandControlPlane::HostAccepted(int64_t number, int64_t round, int32_t host_shard) {
  Promise<Unit> accepted;
  bool settled = false;
  {
    absl::MutexLock lock(&mu_);
    auto g = generations_.find(number);
    if (g == generations_.end()) return;
    auto r = g->second->pending.find(round);
    if (r == g->second->pending.end()) return;                                // its other hosts left
    if (host_shard < 0 || host_shard >= g->second->def.hosts_size()) return;  // the graph has no such shard
    r->second.hosts.erase(g->second->def.hosts(host_shard));
    if (!r->second.hosts.empty()) return;
    settled = r->second.settled;
    accepted = std::move(r->second.accepted);
    g->second->pending.erase(r);
    DropIdleLocked();
  }
  if (!settled) accepted.Set(Unit{});
}

void IslandControlPlane::DropIdleLocked() {
  for (auto it = generations_.begin(); it != generations_.end();) {
    if (it->first == current_ || !it->second->pending.empty()) {
      ++it;
      continue;
    }
    options_.service->RemoveEngine(it->second->engine->graph().name());
    it = generations_.erase(it);
  }
}

}  // namespace pathways
