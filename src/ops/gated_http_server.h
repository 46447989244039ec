// cpp-httplib's Server whose connections hold a thread only while a request is being answered.
//
// cpp-httplib 0.11 (Debian 12's) serves each connection on one pool thread from accept to close,
// and its timeouts bound each read, not a request: a client that trickles a byte per read timeout
// holds its thread for as long as it likes, and a few dozen idle connections hold every thread,
// so whatever comes after waits (slowloris). Here one thread polls every open connection until
// its request head (request line and headers) is complete, with a deadline for the whole head and
// a byte limit on it; only then does a pool thread run cpp-httplib's request handling (routes,
// handlers, the response) on the buffered head. A kept-alive connection goes back to the polling
// thread between requests. A slow or silent client costs a descriptor and a buffer, never a
// thread, and is closed at its deadline.
//
// The limits come from the Server's own settings: the read timeout is the deadline for a whole
// request head (answered 408 when it passes), the keep-alive timeout how long a kept connection
// may stay idle, the write timeout the deadline for answering a request, and the keep-alive max
// count the requests one connection may make. Beyond `max_connections` open at once, the
// connections that have waited longest for their request heads are answered 503 and closed to
// make room, so a flood of slow connections cannot keep out a client that sends its request at
// once; at twice the bound (a moment's burst) newcomers are refused outright.
//
// Configure it as an httplib::Server (except `new_task_queue`, which it sets), then listen on one
// thread and stop() from any. Destroying it closes every connection and joins its threads, which
// takes at most one request's write timeout.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pathways {

struct HttpGateOptions {
  int threads = 4;            // answering requests; connections waiting for a head hold none
  int max_connections = 256;  // open at once, including those being answered (see above)
  size_t max_head_bytes = 16 << 10;  // request line and headers; beyond it: 431
};

class GatedHttpServer : public httplib::Server {
 public:
  explicit GatedHttpServer(HttpGateOptions options = {});
  ~GatedHttpServer() override;

  // Binds to ip:port (0: a free port) as bind_to_port does, and returns the port, or -1. Its
  // listen backlog is `backlog`, not cpp-httplib's 5: a burst of connections beyond the backlog
  // waits for the clients' SYN retries, a second or more.
  int Bind(const std::string& ip, int port, int backlog = 512);

  // Connections open now (waiting for a request head, queued, or being answered).
  int open_connections() const;

 private:
  // A connection between requests: the bytes read and not yet handled, and the requests it made.
  struct Connection {
    int fd = -1;
    std::string unread;
    int answered = 0;
    absl::Time deadline;  // for its next request head to be complete
  };

  // Called by cpp-httplib on the accepting thread (its task queue runs tasks in place): hands the
  // new connection to the polling thread, or refuses it beyond max_connections.
  bool process_and_close_socket(int sock) override;

  void Wait(Connection connection);  // for its next request head, on the polling thread
  void Poll();                       // the polling thread
  void Evict(std::vector<Connection>& waiting, int excess);
  void Answer();                     // a pool thread
  // Reads what `connection` has sent; false once it is closed (and counted out).
  bool ReadHead(Connection& connection);
  void Close(int fd, const char* reply = nullptr);  // counts it out

  const HttpGateOptions options_;
  const int wake_fd_;  // an eventfd: a connection was handed to the polling thread, or stopping

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Connection> arriving_ ABSL_GUARDED_BY(mu_);  // for the polling thread to take up
  std::deque<Connection> complete_ ABSL_GUARDED_BY(mu_);   // heads complete, for the pool

  std::thread poller_;
  std::vector<std::thread> pool_;
};

}  // namespace pathways
