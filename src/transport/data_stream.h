// Data streams: clients move arrays to and from a worker over plain TCP connections instead of
// gRPC. A fetch: the worker writes a shard's bytes from device memory to the socket and the
// client reads them straight from it, with a small header before. A put: the client writes a
// shard's bytes and the worker reads them straight into a device buffer, where they wait for the
// put op (sent in the client's order through gRPC, without the bytes) that names them. Through
// gRPC the bytes were copied four times into fresh memory (protobuf, gRPC's slices, both ways):
// a 64 MiB fetch ran at 0.13-0.18 GB/s, a put at 0.19. The worker's side is
// worker/data_stream_server.h.
//
// The protocol, integers little-endian:
//   client, once per connection: "PWDATA01", u32 n, the token (n bytes, empty when none);
//   client, per request, one at a time: u32 n, a serialized rpc::StreamRequest (at most
//     kMaxStreamRequestBytes); for a stage request, the shard's bytes right after (as many as
//     its spec says);
//   worker, per fetch: a kStreamWaiting byte each keepalive interval while the data is not ready
//     (so a client tells a frozen worker from a long computation), then kStreamHeader, u32 n, a
//     serialized rpc::StreamHeader, then, when its code is OK and the request was not status
//     only, every shard's bytes in the header's order;
//   worker, per stage request, once it has every byte: kStreamHeader, u32 n, rpc::StreamHeader;
//   worker, per enqueue request (a client's ops, as through gRPC's Worker.Enqueue), once the ops
//     are taken: kStreamHeader, u32 n, rpc::StreamHeader with the Enqueue's status.
//     One it refuses before the bytes (a bad device or spec, no memory) is answered at once and
//     the connection closed; a client still sending then mostly sees the connection reset.
// Streams are not encrypted: with TLS on, workers offer none and clients use gRPC.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/future.h"
#include "proto/pathways.pb.h"
#include "transport/stream_listener.h"

namespace pathways {

// A fetch's response, shared: futures' continuations copy their values, and shards' bytes are
// large. Assembling an array may take the bytes out (client/fetch.cc).
using FetchedShards = std::shared_ptr<rpc::FetchResponse>;

inline constexpr char kDataStreamMagic[] = "PWDATA01";  // 8 bytes on the wire
inline constexpr uint32_t kMaxStreamRequestBytes = 1 << 20;
// How long a client waits for the answer to an enqueue (the worker sends no keepalives while it
// applies the ops): the deadline of gRPC's Enqueue.
inline constexpr absl::Duration kEnqueueAnswerBound = absl::Seconds(60);

struct DataStreamTiming {
  // How often a worker says it is still waiting for the data.
  absl::Duration keepalive = absl::Seconds(1);
  // How long a client waits for any byte (a keepalive, the header, the next chunk) before it
  // gives up on the worker as frozen or cut off.
  absl::Duration silence = absl::Seconds(5);
  // Connecting and the hello.
  absl::Duration connect = absl::Seconds(5);
  // A worker reads a staged put's bytes at least this fast on average (after a first `silence`):
  // a client trickling them would hold one of the stream's threads and the landing buffer for as
  // long as it liked. A stage cut off this way is sent again through gRPC, as any refused one.
  double min_stage_bytes_per_second = 1 << 20;
  // A client's connection idle this long is closed and its thread ends (before the worker's own
  // idle bound closes it): a client that once talked to many hosts keeps no running thread for
  // them (what is left of one, its stack, goes at the next request to that worker).
  absl::Duration client_idle = absl::Minutes(4);
};

// One client process's data streams to one worker: up to kMaxConnections connections, each
// with a thread that runs one request at a time (so a fetch that waits for a long computation
// holds only its own connection), for as long as the connection is in use (timing.client_idle).
// Thread-safe.
class DataStreamClient {
 public:
  static constexpr int kMaxConnections = 8;

  // `worker` names the worker in errors; `ip` and `port` are where its stream listens. Connections
  // show `token` when given, else the process's (TokenOr).
  DataStreamClient(std::string worker, std::string ip, int port, DataStreamTiming timing = {},
                   std::optional<std::string> token = std::nullopt);
  ~DataStreamClient();  // fails requests in flight (their sockets are shut down), joins the threads
  DataStreamClient(const DataStreamClient&) = delete;
  DataStreamClient& operator=(const DataStreamClient&) = delete;

  // Sends `request` on an idle connection (or a new one); the response carries the shards' data
  // as rpc::Fetch's does. A response that would hold more than `max_bytes` of shard data is
  // refused. nullopt when every connection is busy: the caller uses gRPC instead. Errors name the
  // worker; the future completes on a connection's thread.
  std::optional<Future<FetchedShards>> Fetch(rpc::FetchRequest request, uint64_t max_bytes);
  // Sends `request` and then `bytes` (exactly the request's spec's size), which the worker keeps
  // for the put op that names the same dest. Complete once the worker has them all. As Fetch,
  // nullopt when every connection is busy.
  std::optional<Future<Unit>> Stage(rpc::StageRequest request, std::shared_ptr<const std::string> bytes);
  // Sends a client's ops, answered as Worker.Enqueue answers them. A request larger than
  // kMaxStreamRequestBytes, or none idle: nullopt.
  std::optional<Future<Unit>> Enqueue(const rpc::EnqueueRequest& request);
  // Whether a request's error means the worker never served it, so that it may be sent another
  // way: the stream could not be dialed (kUnreachable: the worker may have restarted with another
  // stream port, or the port is not reachable from here), or the worker turned it away or closed
  // the connection before answering (kBusy: full, or going; never for an enqueue written whole,
  // whose ops the worker may have taken).
  enum class NotSentReason { kSent, kUnreachable, kBusy };
  static NotSentReason WhyNotSent(const absl::Status& status);
  // Fails what is queued (Cancelled) and lets the threads end, without waiting for them; later
  // requests get nullopt. The destructor also joins them (so it must not run on one of them).
  void Stop();
  // Waits until at most `n` connections have a thread (tests): whether they did within `timeout`.
  bool WaitForConnectionsAtMost(int n, absl::Duration timeout);

 private:
  // One request: a fetch, or a stage request with the bytes that follow it.
  struct Request {
    rpc::StreamRequest message;
    std::shared_ptr<const std::string> payload;  // stage requests only
    uint64_t max_bytes = 0;                       // fetches only
  };
  struct Connection {
    std::thread thread;
    int fd = -1;  // set and closed under mu_, used by the thread
    bool busy = false;
    bool ended = false;  // idle too long: its thread is returning (the next Submit joins it), and it takes no request
    std::optional<Request> request;
    Promise<FetchedShards> promise;
  };
  // Hands `request` to an idle connection (or a new one): nullopt when none is to be had.
  std::optional<Future<FetchedShards>> Submit(Request request);
  void Serve(Connection* c);
  // One request on `c`, dialing when it has no live connection.
  absl::StatusOr<FetchedShards> Exchange(Connection* c, const Request& request);
  // What a failed exchange heard from the worker before it failed.
  enum class Heard { kNothing, kSilence, kSomething };
  // One request and its answer on `fd`.
  // `written`: the whole request (and a stage's bytes) went out.
  absl::StatusOr<FetchedShards> RunOne(int fd, const Request& request, Heard* heard, bool* written);
  absl::StatusOr<int> Dial();
  void SetFd(Connection* c, int fd);

  const std::string worker_, ip_;
  const int port_;
  const DataStreamTiming timing_;
  const std::optional<std::string> token_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pathways
