// Fetch streams: clients read arrays from a worker over plain TCP connections instead of gRPC.
// The worker writes a shard's bytes from device memory to the socket and the client reads them
// straight from it, with a small header before; through gRPC the bytes were copied four times
// into fresh memory (protobuf, gRPC's slices, both ways) and a 64 MiB fetch ran at 0.13-0.18
// GB/s. The worker's side is worker/fetch_stream_server.h.
//
// The protocol, integers little-endian:
//   client, once per connection: "PWFETCH1", u32 n, the token (n bytes, empty when none);
//   client, per request, one at a time: u32 n, a serialized rpc::FetchRequest (at most
//     kMaxFetchRequestBytes);
//   worker, per request: a kWaiting byte each keepalive interval while the data is not ready
//     (so a client tells a frozen worker from a long computation), then kHeader, u32 n, a
//     serialized rpc::FetchStreamHeader, then, when its code is OK and the request was not status
//     only, every shard's bytes in the header's order.
// Streams are not encrypted: with TLS on, workers offer none and clients fetch through gRPC.
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

namespace pathways {

// A fetch's response, shared: futures' continuations copy their values, and shards' bytes are
// large. Assembling an array may take the bytes out (client/fetch.cc).
using FetchedShards = std::shared_ptr<rpc::FetchResponse>;

inline constexpr char kFetchStreamMagic[] = "PWFETCH1";  // 8 bytes on the wire
inline constexpr uint32_t kMaxFetchRequestBytes = 1 << 20;
inline constexpr uint32_t kMaxFetchHeaderBytes = 16 << 20;
inline constexpr uint32_t kMaxFetchTokenBytes = 4096;
inline constexpr char kFetchWaiting = 'W';
inline constexpr char kFetchHeader = 'H';

struct FetchStreamTiming {
  // How often a worker says it is still waiting for the data.
  absl::Duration keepalive = absl::Seconds(1);
  // How long a client waits for any byte (a keepalive, the header, the next chunk) before it
  // gives up on the worker as frozen or cut off.
  absl::Duration silence = absl::Seconds(5);
  // Connecting and the hello.
  absl::Duration connect = absl::Seconds(5);
};

// One client process's fetch streams to one worker: up to kMaxConnections connections, each
// with a thread that runs one fetch at a time (so a fetch that waits for a long computation
// holds only its own connection). Thread-safe.
class FetchStreamClient {
 public:
  static constexpr int kMaxConnections = 8;

  // `worker` names the worker in errors; `ip` and `port` are where its stream listens.
  FetchStreamClient(std::string worker, std::string ip, int port, FetchStreamTiming timing = {});
  ~FetchStreamClient();  // fails fetches in flight (Cancelled), joins the threads
  FetchStreamClient(const FetchStreamClient&) = delete;
  FetchStreamClient& operator=(const FetchStreamClient&) = delete;

  // Sends `request` on an idle connection (or a new one); the response carries the shards' data
  // as rpc::Fetch's does. A response that would hold more than `max_bytes` of shard data is
  // refused. nullopt when every connection is busy: the caller uses gRPC instead. Errors name the
  // worker; the future completes on a connection's thread.
  std::optional<Future<FetchedShards>> Fetch(rpc::FetchRequest request, uint64_t max_bytes);
  // Whether a fetch's error means the worker never served it, so that it may be sent another
  // way: the stream could not be dialed (kUnreachable: the worker may have restarted with another
  // stream port, or the port is not reachable from here), or the worker turned it away or closed
  // the connection before answering (kBusy: full, or going).
  enum class NotSentReason { kSent, kUnreachable, kBusy };
  static NotSentReason WhyNotSent(const absl::Status& status);
  // Fails what is queued (Cancelled) and lets the threads end, without waiting for them; later
  // fetches get nullopt. The destructor also joins them (so it must not run on one of them).
  void Stop();

 private:
  struct Connection {
    std::thread thread;
    int fd = -1;  // set and closed under mu_, used by the thread
    bool busy = false;
    std::optional<rpc::FetchRequest> request;
    uint64_t max_bytes = 0;
    Promise<FetchedShards> promise;
  };
  void Serve(Connection* c);
  // One fetch on `c`, dialing when it has no live connection.
  absl::StatusOr<FetchedShards> Exchange(Connection* c, const rpc::FetchRequest& request, uint64_t max_bytes);
  // What a failed exchange heard from the worker before it failed.
  enum class Heard { kNothing, kSilence, kSomething };
  // One request and its answer on `fd`.
  absl::StatusOr<FetchedShards> RunOne(int fd, const rpc::FetchRequest& request, uint64_t max_bytes, Heard* heard);
  absl::StatusOr<int> Dial();
  void SetFd(Connection* c, int fd);

  const std::string worker_, ip_;
  const int port_;
  const FetchStreamTiming timing_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);
};

// Little-endian u32 framing, shared with the worker's side.
std::string EncodeFetchU32(uint32_t v);
uint32_t DecodeFetchU32(const char* p);

}  // namespace pathways
