// A worker's side of the data streams (protocol in transport/data_stream.h): a listener beside
// the worker's gRPC port, one thread per connection, each answering its client's requests in
// turn: a fetch's shard bytes written from their device buffers to the socket, a staged put's
// read from the socket into the device buffer that will hold them. A connection is admitted by
// the token (the tenants' or the cluster's, as the worker's gRPC calls are), each request by the
// credential of the client it names. A connection gets its thread once its hello is in: until
// then it waits in the acceptor's poll set, so silent connections hold descriptors, not threads.
// Bounded: at most kMaxConnections served (more are turned away at once, told they were not
// served), kMaxGreeting waiting for
// their hellos, each within the connect bound, requests of at most kMaxStreamRequestBytes, idle
// connections closed after kIdle; staged bytes are device memory, charged as any buffer.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/future.h"
#include "device/device.h"
#include "proto/pathways.pb.h"
#include "transport/data_stream.h"

namespace pathways {

class DataStreamServer {
 public:
  static constexpr int kMaxConnections = 256;
  // Connections whose hello has not all come (within the connect bound) wait without a thread,
  // this many at most: beyond it the oldest is closed.
  static constexpr size_t kMaxGreeting = 1024;
  static constexpr absl::Duration kIdle = absl::Minutes(10);

  // What the worker does with (credential-checked) requests.
  struct Handlers {
    // The buffers a fetch asks for, once they are ready.
    std::function<Future<std::vector<BufferPtr>>(const rpc::FetchRequest&)> fetch;
    // A device buffer for a stage request's bytes (of its spec), or why there is none.
    std::function<absl::StatusOr<BufferPtr>(const rpc::StageRequest&)> land;
    // The bytes are all in the buffer `land` gave: it waits for its put op.
    std::function<absl::Status(const rpc::StageRequest&, BufferPtr)> keep;
  };

  // Listens on `ip` (a port of its own, or `port`). Connections must show `token` or `also`
  // (when not empty); an empty `token` admits every connection.
  // At most `max_connections` connections are served at once (each with a thread).
  static absl::StatusOr<std::unique_ptr<DataStreamServer>> Start(const std::string& ip, std::string token,
                                                                 std::string also, Handlers handlers,
                                                                 DataStreamTiming timing = {}, int port = 0,
                                                                 int max_connections = kMaxConnections);
  ~DataStreamServer();  // closes the listener and every connection, joins the threads
  DataStreamServer(const DataStreamServer&) = delete;
  DataStreamServer& operator=(const DataStreamServer&) = delete;

  int port() const { return port_; }
  // Requests answered so far, counted as their answers start (tests).
  int64_t answered() const;

 private:
  struct Connection {
    int fd;
    std::thread thread;
    bool finished = false;
  };
  DataStreamServer(int listen_fd, int port, int wake_fd, std::string token, std::string also, Handlers handlers,
                   DataStreamTiming timing, int max_connections);
  struct Greeting;
  enum class Heard { kMore, kHello, kWrongToken, kBad };
  // Reads what has come of `g`'s hello, without blocking.
  Heard Listen(Greeting& g);
  // Accepts connections and reads their hellos; a connection that said hello goes to Admit.
  void AcceptLoop();
  // A thread for the connection, or it is turned away.
  void Admit(int fd);
  void Serve(Connection* c);
  void TurnAway(int fd, const absl::Status& why, bool not_served);
  // Answer one request; an error means the stream is unusable (the connection closes).
  absl::Status AnswerFetch(int fd, const rpc::FetchRequest& request);
  absl::Status AnswerStage(int fd, const rpc::StageRequest& request);
  // Sends a header with `status`: why a request is refused, or OK.
  absl::Status SendStatus(int fd, const absl::Status& why);
  bool stopping() const;

  const int listen_fd_, port_, wake_fd_;
  const std::string token_, also_;
  const Handlers handlers_;
  const DataStreamTiming timing_;
  const int max_connections_;
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
