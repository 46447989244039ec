// Dataflow traffic over the emulated data-centre network (core/dcn_emulation.h): batches for a
// host of another island are held until the emulated link would have delivered them, in order
// per peer; everything else passes straight through.
#pragma once

#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "core/dcn_emulation.h"
#include "dataflow/engine.h"

namespace pathways::dataflow {

// Wraps another transport. Thread-safe; `inner` and `dcn` must outlive it.
class DcnTransport : public Transport {
 public:
  DcnTransport(Transport& inner, DcnEmulation& dcn);
  ~DcnTransport() override;  // delivers what it still holds
  void Send(const std::string& host, const std::string& graph, std::vector<Envelope> batch) override;

 private:
  void DeliverLoop();

  Transport& inner_;
  DcnEmulation& dcn_;
  absl::Mutex mu_;
  // Held batches by arrival time; a peer's arrivals never decrease (its link is FIFO), and the
  // sequence number keeps equal times in send order.
  std::map<std::pair<absl::Time, int64_t>, std::tuple<std::string, std::string, std::vector<Envelope>>> held_
      ABSL_GUARDED_BY(mu_);
  int64_t sequence_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread deliverer_;
};

}  // namespace pathways::dataflow
