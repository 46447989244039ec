#include "worker/recent_work.h"

#include <algorithm>
#include <map>
#include <string>

#include "core/ids.h"

namespace pathways {

std::vector<rpc::WorkBucket> RecentWork(const std::vector<TraceEvent>& events, int64_t after_us, int64_t width_us,
                                        size_t max_buckets) {
  width_us = std::max<int64_t>(1, width_us);
  auto floor_to = [&](int64_t us) { return (us >= 0 ? us : us - width_us + 1) / width_us * width_us; };
  std::map<int64_t, std::map<std::string, int64_t>> busy;  // bucket start -> client -> micros
  for (const TraceEvent& e : events) {
    if (e.end_us <= after_us || e.end_us < e.start_us) continue;
    const std::string client = ClientLabel(e.label.client);
    for (int64_t b = floor_to(e.start_us); b < e.end_us; b += width_us) {
      const int64_t part = std::min(e.end_us, b + width_us) - std::max(e.start_us, b);
      if (part > 0) busy[b][client] += part;
    }
    // An event without duration still ran: it shows as a bucket with no time, not as nothing.
    if (e.end_us == e.start_us) busy[floor_to(e.start_us)][client] += 0;
  }
  std::vector<rpc::WorkBucket> out;
  auto first = busy.begin();
  if (busy.size() > max_buckets) std::advance(first, static_cast<ptrdiff_t>(busy.size() - max_buckets));
  for (auto it = first; it != busy.end(); ++it) {
    rpc::WorkBucket& bucket = out.emplace_back();
    bucket.set_start_us(it->first);
    bucket.set_end_us(it->first + width_us);
    for (const auto& [client, micros] : it->second) {
      rpc::ClientTime* t = bucket.add_busy();
      t->set_client_id(client);
      t->set_busy_micros(micros);
    }
  }
  return out;
}

}  // namespace pathways
