// A reader of Prometheus' text exposition format for tests, strict enough to catch what a
// scraper refuses: every sample belongs to a family declared before it (HELP and TYPE), names
// and labels are well formed, label values are escaped, values parse, no sample comes twice.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace pathways {

struct PrometheusSamples {
  std::map<std::string, std::string> types;  // family -> type
  std::map<std::string, double> samples;     // "name{labels}" as written -> value
  std::vector<std::string> errors;           // one per line that breaks the format
};

PrometheusSamples ParsePrometheusText(const std::string& text);

}  // namespace pathways
