// The cluster's state in Prometheus' text exposition format (version 0.0.4), as the
// controller's /metrics serves it.
#pragma once

#include <string>

#include "proto/pathways.pb.h"

namespace pathways {

// One sample per device, host, island scheduler and scheduler client in `status`; counters end
// in _total, times are in seconds and sizes in bytes, as Prometheus' conventions ask.
std::string PrometheusText(const rpc::ClusterStatus& status);

// A label value with backslashes, double quotes and line feeds escaped, as the format asks.
std::string EscapeLabelValue(const std::string& value);

}  // namespace pathways
