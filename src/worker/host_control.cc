#include "worker/host_control.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/logging.h"
#include "dataflow/control_graph.h"

namespace pathways {

using L = dataflow::ControlGraphLayout;

// The host's apply shard: each op goes into the host's order as it comes; the round's end needs
// nothing more here (the engine's punctuation to `accepted` is the acknowledgement).
class HostControl::Apply : public dataflow::Operator {
 public:
  Apply(HostControl& control, std::string controller_incarnation)
      : control_(control), controller_incarnation_(std::move(controller_incarnation)) {}
  void OnMessage(dataflow::ShardContext&, int, int, const std::string& payload) override {
    control_.OnScheduled(controller_incarnation_, payload);
  }
  void OnEpochDone(dataflow::ShardContext&) override {}

 private:
  HostControl& control_;
  const std::string controller_incarnation_;
};

namespace {

// The host's report shard passes what the host injects to the controller's done shard.
class Report : public dataflow::Operator {
 public:
  void OnMessage(dataflow::ShardContext& ctx, int, int, const std::string& payload) override {
    ctx.Send(L::kReports, ctx.shard(), payload);
  }
  void OnEpochDone(dataflow::ShardContext&) override {}
};

// Shards that live elsewhere never run here.
class Elsewhere : public dataflow::Operator {
 public:
  void OnMessage(dataflow::ShardContext&, int, int, const std::string&) override {}
  void OnEpochDone(dataflow::ShardContext&) override {}
};

}  // namespace

HostControl::HostControl(HostControlOptions options) : options_(std::move(options)) {}

HostControl::~HostControl() { Shutdown(); }

void HostControl::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    LeaveAllLocked();
  }
  engines_.ShutdownAll();  // batches still queued hold them; their operators refer to this object
}

void HostControl::LeaveAllLocked() {
  for (const Generation& g : generations_) options_.service->RemoveEngine(g.engine->graph().name());
  generations_.clear();
  early_.clear();
}

size_t HostControl::num_generations() {
  absl::MutexLock lock(&mu_);
  return generations_.size();
}

absl::Status HostControl::Join(const rpc::ControlGraph& def) {
  auto graph = dataflow::MakeControlGraph(def);
  if (!graph.ok()) return graph.status();
  int32_t shard = -1;
  for (int k = 0; k < def.hosts_size(); ++k) {
    if (def.hosts(k) == options_.host) shard = k;
  }
  if (shard < 0) {
    return absl::InvalidArgumentError(absl::StrCat("control graph ", (*graph)->name(), " does not name host ", options_.host));
  }
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError(absl::StrCat("host ", options_.host, " is shutting down"));
  if (def.controller_incarnation() != controller_incarnation_) {
    // A controller this host has not heard from (a first one, or one that restarted): its order
    // starts at 1, and what the previous one sent is moot.
    if (!controller_incarnation_.empty()) {
      PW_LOG(Info) << "host " << options_.host << ": controller " << def.controller() << " is a new incarnation; "
                   << early_.size() << " early ops of the previous one dropped";
    }
    LeaveAllLocked();
    next_order_ = 1;
    oldest_generation_ = 0;
    broken_ = absl::OkStatus();  // the order that was lost was the previous controller's
    controller_incarnation_ = def.controller_incarnation();
  }
  oldest_generation_ = std::max(oldest_generation_, def.oldest_generation());
  if (def.generation() < oldest_generation_) return absl::OkStatus();  // already out of use
  for (const Generation& g : generations_) {
    if (g.def.generation() == def.generation()) return absl::OkStatus();
  }
  auto engine = std::make_shared<dataflow::Engine>(
      options_.host, *std::move(graph),
      [this, incarnation = def.controller_incarnation()](int node, int) -> std::unique_ptr<dataflow::Operator> {
        if (node == L::kApply) return std::make_unique<Apply>(*this, incarnation);
        if (node == L::kReport) return std::make_unique<Report>();
        return std::make_unique<Elsewhere>();
      },
      *options_.transport, *options_.executor);
  // Its operators queue ops and send, never waiting: batches are handled as they are read.
  engine->set_handles_on_arrival(true);
  // Generations arrive in order but joins may not: keep them sorted, newest last.
  auto at = generations_.end();
  while (at != generations_.begin() && std::prev(at)->def.generation() > def.generation()) --at;
  generations_.insert(at, Generation{def, shard, engine});
  // Hands over what came before the join. Control batches are a few hundred bytes, held apart
  // from programs' (DataflowService): only a flood of batches for control graphs makes one be
  // dropped. A lost one
  // may have held scheduled ops, whose place in the island's order is then unknown here, as with
  // an op that cannot be read.
  if (dataflow::LostEpochs lost = options_.service->AddEngine(engine.get()); !lost.empty()) {
    BreakLocked(absl::StrCat("host ", options_.host, ": control generation ", def.generation(),
                             " lost batches before this host joined it (", lost.why,
                             "), so ops of the island's order may never come; the host leaves the island"));
  }
  engines_.Add(engine);
  // Graphs the controller no longer uses go (their stragglers are dropped by the service).
  while (generations_.size() > kMaxGenerations ||
         (!generations_.empty() && generations_.front().def.generation() < oldest_generation_)) {
    options_.service->RemoveEngine(generations_.front().engine->graph().name());
    generations_.pop_front();
  }
  return absl::OkStatus();
}

void HostControl::BreakLocked(const std::string& why) {
  if (!broken_.ok()) return;  // the first reason stands
  broken_ = absl::UnavailableError(why);
  PW_LOG(Error) << why;
}

absl::Status HostControl::Broken() {
  absl::MutexLock lock(&mu_);
  if (!early_.empty() && absl::Now() - early_since_ > options_.early_wait) {
    BreakLocked(absl::StrCat("host ", options_.host, ": scheduled op ", next_order_, " never came within ",
                             absl::FormatDuration(options_.early_wait), " while ", early_.size(),
                             " later ones waited for it; the host leaves the island"));
  }
  return broken_;
}

void HostControl::OnScheduled(const std::string& controller_incarnation, const std::string& bytes) {
  rpc::ScheduledOp op;
  const bool readable = op.ParseFromString(bytes) && op.order() > 0;
  absl::MutexLock lock(&mu_);
  if (shut_down_ || controller_incarnation != controller_incarnation_) return;  // from a controller gone since
  if (!readable) {
    BreakLocked(absl::StrCat("host ", options_.host, ": a scheduled op from controller ", controller_incarnation,
                             " could not be read (", bytes.size(),
                             " bytes), so its place in the island's order is unknown and every later run here "
                             "would wait for it; the host leaves the island"));
    return;
  }
  if (op.order() < next_order_) {
    PW_LOG(Error) << "host " << options_.host << ": scheduled op " << op.order() << " came twice";
    return;
  }
  const int64_t order = op.order();
  if (order != next_order_ && early_.size() >= kMaxEarlyOps) {
    BreakLocked(absl::StrCat("host ", options_.host, ": scheduled op ", next_order_, " never came while ",
                             early_.size(), " later ones waited for it; the host leaves the island"));
    return;
  }
  early_.emplace(order, std::move(op));
  std::vector<rpc::ScheduledOp> ready;
  for (auto it = early_.begin(); it != early_.end() && it->first == next_order_; it = early_.erase(it), ++next_order_) {
    ready.push_back(std::move(it->second));
  }
  // The clock starts when an op begins to wait (the first to park, or what still waits once the
  // order moved on); an op taken in order at once, the usual case, reads no clock.
  if (ready.empty() ? early_.size() == 1 : !early_.empty()) early_since_ = absl::Now();
  if (ready.empty()) return;
  // Under the lock: the next batch must not overtake this one.
  if (absl::Status s = options_.apply(std::move(ready)); !s.ok()) {
    PW_LOG(Error) << "host " << options_.host << ": scheduled ops refused: " << s;
  }
}

void HostControl::ReportDone(rpc::RunDone done) {
  std::shared_ptr<dataflow::Engine> engine;
  int32_t shard;
  int64_t epoch;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    if (generations_.empty()) {
      PW_LOG(Warning) << "host " << options_.host << ": run " << done.epoch() << " done, but no control graph to report it through";
      return;
    }
    const Generation& g = generations_.back();
    engine = g.engine;
    shard = g.shard;
    done.set_island(g.def.island());
    epoch = next_report_epoch_++;
  }
  std::vector<std::string> payload{done.SerializeAsString()};
  if (absl::Status s = engine->InjectAll(L::kReport, shard, epoch, std::move(payload)); !s.ok()) {
    PW_LOG(Error) << "host " << options_.host << ": run done not reported: " << s;
  }
}

}  // namespace pathways
