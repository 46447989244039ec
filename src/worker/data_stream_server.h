// A worker's side of the data streams (protocol in transport/data_stream.h): a listener beside
// the worker's gRPC port (transport/stream_listener.h), one thread per connection, each
// answering its client's requests in turn: a fetch's shard bytes written from their device
// buffers to the socket, a staged put's read from the socket into the device buffer that will
// hold them, a batch of the client's ops taken into the host's sequence. A connection is admitted by
// the token (the tenants' or the cluster's, as the worker's gRPC calls are), each request by the
// credential of the client it names. Bounded: at most kMaxConnections served (more are turned
// away at once, told they were not served), requests of at most kMaxStreamRequestBytes, idle
// connections closed after kIdle; staged bytes are device memory, charged as any buffer.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"
#include "device/device.h"
#include "proto/pathways.pb.h"
#include "transport/data_stream.h"
#include "transport/stream_listener.h"

namespace pathways {

class DataStreamServer {
 public:
  static constexpr int kMaxConnections = StreamListener::kMaxConnections;
  static constexpr absl::Duration kIdle = absl::Minutes(10);
  // A fetch's answer whose shards hold at most this many bytes goes out in one send.
  static constexpr size_t kOneSendBytes = 64 << 10;

  // What the worker does with (credential-checked) requests.
  struct Handlers {
    // The buffers a fetch asks for, once they are ready.
    std::function<Future<std::vector<BufferPtr>>(const rpc::FetchRequest&)> fetch;
    // A device buffer for a stage request's bytes (of its spec), or why there is none.
    std::function<absl::StatusOr<BufferPtr>(const rpc::StageRequest&)> land;
    // The bytes are all in the buffer `land` gave: it waits for its put op.
    std::function<absl::Status(const rpc::StageRequest&, BufferPtr)> keep;
    // A client's ops, taken as Worker.Enqueue takes them (on the connection's thread).
    std::function<absl::Status(const rpc::EnqueueRequest&)> enqueue;
    // Whether the tenant a connection's token names is refused now (each request is checked);
    // none: never.
    std::function<absl::Status(const std::string& tenant)> refused;
  };

  // Listens on `ip` (a port of its own, or `port`). Connections must show `token` or `also`
  // (when not empty); an empty `token` admits every connection. At most `max_connections`
  // connections are served at once (each with a thread). The same port also serves `more`
  // protocols (the worker's dataflow batches).
  static absl::StatusOr<std::unique_ptr<DataStreamServer>> Start(const std::string& ip, TenantTokens token,
                                                                 std::string also, Handlers handlers,
                                                                 DataStreamTiming timing = {}, int port = 0,
                                                                 int max_connections = kMaxConnections,
                                                                 std::vector<StreamListener::Protocol> more = {});
  ~DataStreamServer();  // closes the listener and every connection, joins the threads
  DataStreamServer(const DataStreamServer&) = delete;
  DataStreamServer& operator=(const DataStreamServer&) = delete;

  int port() const { return listener_->port(); }
  // Requests answered so far, counted as their answers start (tests).
  int64_t answered() const;

 private:
  DataStreamServer(Handlers handlers, DataStreamTiming timing) : handlers_(std::move(handlers)), timing_(timing) {}
  void Serve(int fd, const StreamListener& listener, const std::string& tenant);
  // Answer one request; an error means the stream is unusable (the connection closes).
  absl::Status AnswerFetch(int fd, const rpc::FetchRequest& request, const StreamListener& listener);
  absl::Status AnswerStage(int fd, const rpc::StageRequest& request);
  // Sends a header with `status`: why a request is refused, or OK.
  absl::Status SendStatus(int fd, const absl::Status& why);

  const Handlers handlers_;
  const DataStreamTiming timing_;
  std::unique_ptr<StreamListener> listener_;  // last: it goes first, joining the threads that use the rest
  mutable absl::Mutex mu_;
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
