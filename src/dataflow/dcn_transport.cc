#include "dataflow/dcn_transport.h"

#include "core/executor.h"

namespace pathways::dataflow {

DcnTransport::DcnTransport(Transport& inner, DcnEmulation& dcn) : inner_(inner), dcn_(dcn) {
  deliverer_ = std::thread([this] {
    NameThisThread("dcn-deliver");
    DeliverLoop();
  });
}

DcnTransport::~DcnTransport() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  deliverer_.join();
}

void DcnTransport::Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) {
  if (!dcn_.Crosses(host)) {
    inner_.Send(host, graph, std::move(batch));
    return;
  }
  size_t bytes = 0;
  for (const Envelope& e : batch) bytes += e.payload.size() + 32;  // a rough envelope header
  const absl::Time arrival = dcn_.Arrival(host, bytes, absl::Now());
  absl::MutexLock lock(&mu_);
  held_.emplace(std::make_pair(arrival, sequence_++), std::make_tuple(host, graph, std::move(batch)));
}

void DcnTransport::DeliverLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (held_.empty()) {
      if (stop_) return;
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !held_.empty(); };
      mu_.Await(absl::Condition(&woken));
      continue;
    }
    const absl::Time due = held_.begin()->first.first;
    // Wakes early when another batch comes in (it may be due earlier); on stop, delivers at once.
    if (!stop_ && absl::Now() < due) {
      const size_t before = held_.size();
      auto woken = [this, before]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || held_.size() != before; };
      mu_.AwaitWithDeadline(absl::Condition(&woken), due);
      continue;
    }
    auto node = held_.extract(held_.begin());
    auto& [host, graph, batch] = node.mapped();
    mu_.Unlock();
    inner_.Send(host, graph, std::move(batch));
    mu_.Lock();
  }
}

}  // namespace pathways::dataflow
