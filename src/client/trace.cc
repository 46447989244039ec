// Chrome trace-event JSON of what a client's computations ran where.
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_core.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppend(&out, "\\u00", c < 0x10 ? "0" : "", absl::Hex(static_cast<int>(c)));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

absl::StatusOr<std::string> Client::TraceJson(absl::Time since) {
  PW_ASSIGN_OR_RETURN(rpc::ClusterStatus status, core_->controller().GetStatus());
  rpc::GetTraceRequest request;
  request.set_client_id(core_->id());
  request.set_credential(core_->credential());
  request.set_since_us(since == absl::InfinitePast() ? 0 : absl::ToUnixMicros(since));
  std::map<std::string, Future<rpc::GetTraceResponse>> replies;  // by host, so pids are stable
  for (const rpc::HostStatus& h : status.hosts()) {
    if (h.alive()) replies.emplace(h.address(), core_->worker(h.address())->GetTrace(request));
  }
  std::vector<std::string> events;
  int pid = 0;
  for (auto& [host, reply] : replies) {
    PW_ASSIGN_OR_RETURN(rpc::GetTraceResponse response, reply.Await());
    events.push_back(absl::StrCat(R"({"ph":"M","name":"process_name","pid":)", pid,
                                  R"(,"args":{"name":)", JsonString("host " + host), "}}"));
    std::map<int, bool> devices;
    for (const rpc::TraceEventProto& e : response.events()) {
      if (!devices[e.device()]) {
        devices[e.device()] = true;
        events.push_back(absl::StrCat(R"({"ph":"M","name":"thread_name","pid":)", pid, R"(,"tid":)", e.device(),
                                      R"(,"args":{"name":"cpu:)", e.device(), "\"}}"));
      }
      events.push_back(absl::StrCat(R"({"ph":"X","name":)", JsonString(e.name()), R"(,"pid":)", pid,
                                    R"(,"tid":)", e.device(), R"(,"ts":)", e.start_us(), R"(,"dur":)",
                                    e.end_us() - e.start_us(), R"(,"args":{"program":)", e.program(),
                                    R"(,"run":)", e.run(), R"(,"node":)", e.node(), R"(,"shard":)", e.shard(),
                                    R"(,"client":)", JsonString(core_->id()), "}}"));
    }
    ++pid;
  }
  return absl::StrCat("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", absl::StrJoin(events, ",\n"), "\n]}\n");
}

absl::Status Client::WriteTrace(const std::string& path, absl::Time since) {
  PW_ASSIGN_OR_RETURN(std::string json, TraceJson(since));
  std::ofstream out(path, std::ios::trunc);
  out << json;
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write trace to ", path));
  return absl::OkStatus();
}

}  // namespace pathways
