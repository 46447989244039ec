// A client's schedule requests to the controller over one plain TCP connection to its stream
// listener (transport/stream_listener.h) instead of one unary gRPC call each: on the round trip
// of a small computation a gRPC hop costs 100-200 µs of thread hand-offs, a write and a read on
// a socket a few tens.
//
// The protocol:
//   client: the hello with magic kScheduleStreamMagic and the tenants' (or the cluster's) token;
//   controller: a header frame, OK once admitted (or why not, and the connection closes);
//   client, per request: u32 n (little-endian), a serialized rpc::ScheduleRequest of n bytes (at
//     most kMaxScheduleRequestBytes);
//   controller, per request and in their order: a header frame carrying the request's status,
//     once its runs reach their hosts (as the unary call answers).
// Requests are checked as the unary call's are (the client's credential, then the request).
// A connection that breaks fails the requests still waiting (Unavailable, naming the
// controller); the caller may connect again.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "core/future.h"
#include "proto/pathways.pb.h"
#include "transport/stream_listener.h"

namespace pathways {

inline constexpr char kScheduleStreamMagic[] = "PWSCHD01";
inline constexpr uint32_t kMaxScheduleRequestBytes = 64u << 20;

class ScheduleStream {
 public:
  // Connects to the controller (named `controller` in errors) at `ip`:`port` and is admitted,
  // within `timeout`, showing `token` when given, else the process's (TokenOr).
  static absl::StatusOr<std::unique_ptr<ScheduleStream>> Connect(const std::string& controller, const std::string& ip,
                                                                 int port, absl::Duration timeout,
                                                                 const std::optional<std::string>& token = std::nullopt);
  ~ScheduleStream();  // fails what is still waiting, joins the reader
  ScheduleStream(const ScheduleStream&) = delete;
  ScheduleStream& operator=(const ScheduleStream&) = delete;

  // Sends `request`; complete with the controller's answer (continuations may run on the
  // stream's reader thread). When the request never left this process (the stream was broken
  // already, or its frame could not be written whole), the error says so (NeverSent): it may be
  // sent another way.
  Future<Unit> Schedule(const rpc::ScheduleRequest& request);
  static bool NeverSent(const absl::Status& s);
  // The connection broke: nothing more is sent on it.
  bool broken();

 private:
  // What the reader thread uses: it holds it too, so a stream may go from a continuation that
  // runs on that thread (the thread is then left to end by itself).
  struct State;
  explicit ScheduleStream(std::shared_ptr<State> state);
  static void ReadLoop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_;
  std::thread reader_;
};

// The controller's side: serves one admitted connection, handing each request to `submit`
// (which checks it and returns when its runs reach their hosts) and answering in order, until
// the client closes, the listener stops, or a frame is malformed.
void ServeScheduleStream(int fd, const StreamListener& listener,
                         const std::function<Future<Unit>(const rpc::ScheduleRequest&)>& submit);

}  // namespace pathways
