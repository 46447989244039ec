#include "testing/prometheus_text.h"

#include <cstdlib>
#include <regex>
#include <set>
#include <sstream>

namespace pathways {

PrometheusSamples ParsePrometheusText(const std::string& text) {
  PrometheusSamples p;
  static const std::regex kHelp(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+)");
  static const std::regex kType(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|summary|histogram|untyped))");
  static const std::regex kSample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*")*\})? (\S+))");
  std::istringstream in(text);
  std::string line;
  std::set<std::string> helped;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, kHelp)) {
      helped.insert(m[1]);
    } else if (std::regex_match(line, m, kType)) {
      if (!helped.contains(m[1])) p.errors.push_back("TYPE before HELP: " + line);
      p.types[m[1]] = m[2];
    } else if (std::regex_match(line, m, kSample)) {
      std::string family = m[1];
      for (const char* suffix : {"_sum", "_count", "_bucket"}) {
        const std::string s = suffix;
        if (!p.types.contains(family) && family.size() > s.size() && family.ends_with(s)) {
          family = family.substr(0, family.size() - s.size());
        }
      }
      if (!p.types.contains(family)) p.errors.push_back("sample of an undeclared family: " + line);
      char* end = nullptr;
      const std::string value = m[7];
      const double v = std::strtod(value.c_str(), &end);
      if (end == nullptr || *end != '\0') p.errors.push_back("value does not parse: " + line);
      const std::string key = std::string(m[1]) + std::string(m[2]);
      if (p.samples.contains(key)) p.errors.push_back("sample twice: " + line);
      p.samples[key] = v;
    } else {
      p.errors.push_back("not a line of the format: " + line);
    }
  }
  return p;
}

}  // namespace pathways
