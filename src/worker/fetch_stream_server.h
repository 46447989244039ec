// A worker's side of the fetch streams (protocol in transport/fetch_stream.h): a listener beside
// the worker's gRPC port, one thread per connection, each answering its client's requests in
// turn, the shards' bytes written from their device buffers to the socket. A connection is
// admitted by the token (the tenants' or the cluster's, as the worker's gRPC calls are), each
// request by the credential of the client it names. Bounded: at most kMaxConnections (more are
// closed at once), requests of at most kMaxFetchRequestBytes, a hello within the connect bound,
// idle connections closed after kIdle.
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
#include "transport/fetch_stream.h"

namespace pathways {

class FetchStreamServer {
 public:
  static constexpr int kMaxConnections = 256;
  static constexpr absl::Duration kIdle = absl::Minutes(10);

  // The buffers a (credential-checked) request asks for, once they are ready.
  using FetchFn = std::function<Future<std::vector<BufferPtr>>(const rpc::FetchRequest&)>;

  // Listens on `ip` (a port of its own, or `port`). Connections must show `token` or `also`
  // (when not empty); an empty `token` admits every connection.
  static absl::StatusOr<std::unique_ptr<FetchStreamServer>> Start(const std::string& ip, std::string token,
                                                                  std::string also, FetchFn fetch,
                                                                  FetchStreamTiming timing = {}, int port = 0);
  ~FetchStreamServer();  // closes the listener and every connection, joins the threads
  FetchStreamServer(const FetchStreamServer&) = delete;
  FetchStreamServer& operator=(const FetchStreamServer&) = delete;

  int port() const { return port_; }
  // Requests answered so far, counted as their answers start (tests).
  int64_t answered() const;

 private:
  struct Connection {
    int fd;
    std::thread thread;
    bool finished = false;
  };
  FetchStreamServer(int listen_fd, int port, int wake_fd, std::string token, std::string also, FetchFn fetch,
                    FetchStreamTiming timing);
  void AcceptLoop();
  void Serve(Connection* c);
  absl::Status Hello(int fd);
  void TurnAway(int fd);
  // Answers one request; an error means the stream is unusable (the connection closes).
  absl::Status Answer(int fd, const rpc::FetchRequest& request);
  bool stopping() const;

  const int listen_fd_, port_, wake_fd_;
  const std::string token_, also_;
  const FetchFn fetch_;
  const FetchStreamTiming timing_;
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  int64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pathways
