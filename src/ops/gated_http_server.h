// cpp-httplib's Server whose threads never wait for a client.
//
// cpp-httplib 0.11 (Debian 12's) serves each connection on one pool thread from accept to close,
// and its timeouts bound each read and write, not a request: a client that trickles a byte per
// read timeout, or reads its answer a byte at a time, holds its thread for as long as it likes,
// and a few dozen idle connections hold every thread, so whatever comes after waits (slowloris).
//
// Here one thread polls every open connection: until its request head (request line and headers)
// is complete, within a deadline for the whole head and a byte limit; then a pool thread runs
// cpp-httplib's request handling (routes, handlers) on the buffered head and renders the answer
// into memory; what the socket does not take at once goes back to the polling thread, which sends
// it within a deadline for the whole answer. A kept-alive connection then waits on the polling
// thread for its next request. Slow, silent and non-reading clients cost a descriptor and a
// bounded buffer, never a thread, and are closed at their deadlines.
//
// The limits come from the Server's own settings: the read timeout is the deadline for a whole
// request head (408 when it passes; on a kept connection it runs from the head's first byte), the
// keep-alive timeout how long a kept connection may stay idle, the write timeout the deadline for
// sending an answer, and the keep-alive max count the requests one connection may make. Past
// `max_connections` open at once, the connections that have waited longest (for a head, or for
// their answer to be read) are closed to make room, so a flood of slow connections cannot keep
// out a client that sends its request and reads its answer; at twice the bound (a moment's burst)
// newcomers are refused outright with 503. A request with a body the handlers did not read ends
// its connection after the answer. Heads must end in CRLF CRLF (a bare LF is waited out: 408).
//
// Configure it as an httplib::Server (except `new_task_queue`, which it sets; handlers must not
// block on the network), then listen on one thread and stop() from any. Destroy it only once
// that thread has returned from listening: destroying closes every connection and joins the
// threads, at once.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pathways {

struct HttpGateOptions {
  int threads = 4;                   // answering requests
  int max_connections = 256;         // open at once, however busy (see above)
  size_t max_head_bytes = 16 << 10;  // request line and headers; beyond it: 431
  size_t max_answer_bytes = 16 << 20;  // one answer; beyond it the connection fails
  // Answers rendered but not yet taken by their clients' sockets, all connections together;
  // beyond it the connection whose answer would pass it is closed.
  size_t max_unsent_bytes = 64 << 20;
};

class GatedHttpServer : public httplib::Server {
 public:
  using Clock = std::chrono::steady_clock;

  explicit GatedHttpServer(HttpGateOptions options = {});
  ~GatedHttpServer() override;

  // Binds to ip:port (0: a free port) as bind_to_port does, and returns the port, or -1. Its
  // listen backlog is `backlog`, not cpp-httplib's 5: a burst of connections beyond the backlog
  // waits for the clients' SYN retries, a second or more.
  int Bind(const std::string& ip, int port, int backlog = 512);

  // Connections open now (waiting for a head, queued, being answered, or sending an answer).
  int open_connections() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Connection {
    int fd = -1;
    std::string unread;  // read and not yet handled: the start of its next request
    size_t answered = 0;
    Clock::time_point deadline;  // for its head, or for its answer to be sent
    std::string output;  // an answer not yet sent (from `sent` on)
    size_t sent = 0;
    size_t charged = 0;  // of unsent_: the part of `output` the socket did not take at once
    bool close_after = false;  // once the answer is sent
  };

  // Called by cpp-httplib on the accepting thread (its task queue runs tasks in place): hands the
  // new connection to the polling thread, or refuses it at twice max_connections.
  bool process_and_close_socket(int sock) override;

  // Hands `c` to the pool when its next head is complete, else to the polling thread.
  void Wait(Connection c) ABSL_LOCKS_EXCLUDED(mu_);
  void Poll() ABSL_LOCKS_EXCLUDED(mu_);    // the polling thread
  void Answer() ABSL_LOCKS_EXCLUDED(mu_);  // a pool thread
  // Reads what `c` has sent, up to a complete head; false once it is closed (and counted out).
  bool ReadHead(Connection& c) ABSL_LOCKS_EXCLUDED(mu_);
  // Sends what the socket takes of `c`'s answer; false once it is closed (and counted out).
  bool SendSome(Connection& c) ABSL_LOCKS_EXCLUDED(mu_);
  // After an answer is sent: closes `c`, or waits for its next request.
  void AfterAnswer(Connection c) ABSL_LOCKS_EXCLUDED(mu_);
  void Evict(std::vector<Connection>& waiting, int excess) ABSL_LOCKS_EXCLUDED(mu_);
  void Close(Connection& c, const char* reply = nullptr) ABSL_LOCKS_EXCLUDED(mu_);  // counts it out

  const HttpGateOptions options_;
  const int wake_fd_;  // an eventfd: a connection was handed to the polling thread, or stopping

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  size_t unsent_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of answers held for the polling thread to send
  std::vector<Connection> arriving_ ABSL_GUARDED_BY(mu_);  // for the polling thread to take up
  std::deque<Connection> complete_ ABSL_GUARDED_BY(mu_);   // heads complete, for the pool

  std::thread poller_;
  std::vector<std::thread> pool_;
};

}  // namespace pathways
