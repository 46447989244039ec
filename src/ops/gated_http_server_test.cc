#include "ops/gated_http_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/loopback.h"

namespace pathways {
namespace {

// A server listening on loopback with one route, /hi, until the end of the test.
class Serving {
 public:
  explicit Serving(HttpGateOptions gate, int timeout_seconds = 30, std::string body = "hello")
      : server_(std::make_unique<GatedHttpServer>(gate)) {
    server_->set_read_timeout(timeout_seconds, 0);
    server_->set_write_timeout(timeout_seconds, 0);
    server_->set_keep_alive_timeout(timeout_seconds);
    server_->set_keep_alive_max_count(3);
    server_->Get("/hi", [body](const httplib::Request&, httplib::Response& res) { res.set_content(body, "text/plain"); });
    port_ = server_->Bind("127.0.0.1", 0);
    thread_ = std::thread([this] { server_->listen_after_bind(); });
    while (!server_->is_running()) std::this_thread::yield();
  }
  ~Serving() { Stop(); }
  void Stop() {
    if (!server_) return;
    server_->stop();
    thread_.join();
    server_.reset();
  }
  int port() const { return port_; }
  GatedHttpServer& server() { return *server_; }
  httplib::Client Client() const {
    httplib::Client client("127.0.0.1", port_);
    client.set_connection_timeout(10);
    client.set_read_timeout(20);  // a regression that holds the request fails here
    return client;
  }

 private:
  std::unique_ptr<GatedHttpServer> server_;
  int port_ = 0;
  std::thread thread_;
};

// A connection whose reads give up after `bound_seconds`: a regression fails instead of hanging.
int Dial(int port, int bound_seconds = 60) {
  const int fd = testing::DialLoopback(port);
  timeval bound{bound_seconds, 0};
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
  return fd;
}

void Send(int fd, const std::string& bytes) { ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), bytes.size()); }

// Everything the server sends until it closes the connection; *closed says whether it did (rather
// than the read giving up at the connection's bound).
std::string ReadToEnd(int fd, bool* closed = nullptr) {
  std::string all;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) all.append(buffer, n);
  if (closed != nullptr) *closed = n == 0 || (n < 0 && errno == ECONNRESET);
  return all;
}

// Whether an answer's Content-Length is the size of the body that follows its head.
bool LengthMatches(const std::string& answer) {
  const size_t head = answer.find("\r\n\r\n");
  const size_t at = answer.find("Content-Length: ");
  if (head == std::string::npos || at == std::string::npos || at > head) return false;
  return std::stoul(answer.substr(at + 16)) == answer.size() - head - 4;
}

// Reads until `count` answers to /hi have come (each ends with the body "hello").
std::string ReadAnswers(int fd, int count) {
  std::string all;
  char buffer[4096];
  auto answers = [&] {
    int n = 0;
    for (size_t at = all.find("hello"); at != std::string::npos; at = all.find("hello", at + 1)) ++n;
    return n;
  };
  while (answers() < count) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    all.append(buffer, n);
  }
  return all;
}

constexpr char kRequest[] = "GET /hi HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

// Clients that trickle their request heads a byte at a time, as long as the test lasts.
class Tricklers {
 public:
  Tricklers(int port, int count) {
    for (int i = 0; i < count; ++i) {
      const int fd = Dial(port);
      EXPECT_GE(fd, 0);
      fds_.push_back(fd);
      Send(fd, "GET /hi HTTP/1.1\r\n");
    }
    thread_ = std::thread([this] {
      // A header that never ends, a byte per connection every 50 ms, at most 20 s of it.
      for (int round = 0; round < 400 && !stop_.load(); ++round) {
        for (int fd : fds_) (void)send(fd, "x", 1, MSG_NOSIGNAL);
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  ~Tricklers() {
    stop_ = true;
    thread_.join();
    for (int fd : fds_) close(fd);
  }

 private:
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The slowloris attack: more trickling clients than threads, each with a deadline far away. A
// well-formed request is answered meanwhile (cpp-httplib's own pool would keep it waiting).
TEST(GatedHttpServerTest, ClientsTricklingTheirHeadsHoldNoThread) {
  HttpGateOptions gate;
  gate.threads = 1;
  Serving serving(gate, /*timeout_seconds=*/60);
  Tricklers tricklers(serving.port(), 20);
  httplib::Client client = serving.Client();
  for (int i = 0; i < 3; ++i) {
    auto r = client.Get("/hi");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "hello");
  }
}

TEST(GatedHttpServerTest, AHeadNotCompleteByItsDeadlineIsAnswered408AndClosed) {
  Serving serving(HttpGateOptions{}, /*timeout_seconds=*/1);
  const int fd = Dial(serving.port());
  ASSERT_GE(fd, 0);
  Send(fd, "GET /hi HTTP/1.1\r\n");
  std::string answer;
  // A byte every 50 ms keeps every read within any per-read timeout; the head's deadline ends it.
  for (int i = 0; i < 1200 && answer.empty(); ++i) {
    (void)send(fd, "x", 1, MSG_NOSIGNAL);
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0) answer = ReadToEnd(fd);
  }
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  EXPECT_TRUE(LengthMatches(answer)) << answer;
  close(fd);
  // And a silent connection: closed at its deadline too.
  const int silent = Dial(serving.port());
  ASSERT_GE(silent, 0);
  EXPECT_EQ(ReadToEnd(silent).rfind("HTTP/1.1 408", 0), 0u);
  close(silent);
}

TEST(GatedHttpServerTest, AHeadOverItsByteLimitIsAnswered431) {
  HttpGateOptions gate;
  gate.max_head_bytes = 1024;
  Serving serving(gate);
  const int fd = Dial(serving.port());
  ASSERT_GE(fd, 0);
  std::string head = "GET /hi HTTP/1.1\r\n";
  for (int i = 0; i < 200; ++i) head += absl::StrCat("h", i, ": v\r\n");  // many short headers
  head += "\r\n";
  (void)send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  const std::string answer = ReadToEnd(fd);
  EXPECT_EQ(answer.rfind("HTTP/1.1 431", 0), 0u) << answer;
  EXPECT_TRUE(LengthMatches(answer)) << answer;
  close(fd);
  auto r = serving.Client().Get("/hi");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// Requests sent back to back on one connection are all answered, in order, up to the
// keep-alive count (3 here); the connection is closed after the last.
TEST(GatedHttpServerTest, AKeptConnectionAnswersPipelinedRequestsUpToItsCount) {
  Serving serving(HttpGateOptions{});
  const int fd = Dial(serving.port());
  ASSERT_GE(fd, 0);
  Send(fd, absl::StrCat(kRequest, kRequest));
  const std::string two = ReadAnswers(fd, 2);
  EXPECT_EQ(two.rfind("HTTP/1.1 200", 0), 0u) << two;
  EXPECT_NE(two.find("HTTP/1.1 200", 1), std::string::npos) << two;
  Send(fd, absl::StrCat(kRequest, kRequest));
  const std::string rest = ReadToEnd(fd);  // the third is answered, then the connection closes
  EXPECT_NE(rest.find("Connection: close"), std::string::npos) << rest;
  EXPECT_EQ(rest.find("HTTP/1.1 200", 1), std::string::npos) << "a fourth request was answered: " << rest;
  close(fd);
}

// Beyond max_connections, the connections that have waited longest for a request head make room:
// a client that sends its request at once is served whatever number of slow ones came before.
TEST(GatedHttpServerTest, BeyondMaxConnectionsTheLongestWaitingMakeRoom) {
  HttpGateOptions gate;
  gate.max_connections = 3;
  Serving serving(gate, /*timeout_seconds=*/60);
  std::vector<int> slow, kept;
  for (int i = 0; i < 3; ++i) {
    const int fd = Dial(serving.port());
    ASSERT_GE(fd, 0);
    Send(fd, "GET /hi HTTP/1.1\r\n");
    slow.push_back(fd);
  }
  for (int i = 0; i < 3; ++i) {  // each, kept open after its answer, takes a slow one's place
    const int fd = Dial(serving.port());
    ASSERT_GE(fd, 0);
    Send(fd, kRequest);
    const std::string answer = ReadAnswers(fd, 1);
    EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
    kept.push_back(fd);
  }
  for (int fd : slow) {
    const std::string answer = ReadToEnd(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 503", 0), 0u) << answer;
    close(fd);
  }
  EXPECT_EQ(serving.server().open_connections(), 3);
  for (int fd : kept) close(fd);
}

// A client reading its answer slowly (as slowly as it likes, never so slowly that one write
// waits long) holds no thread: the next request is answered meanwhile, and the slow answer is cut
// at the write deadline.
TEST(GatedHttpServerTest, AClientReadingItsAnswerSlowlyHoldsNoThreadAndIsCutAtTheDeadline) {
  HttpGateOptions gate;
  gate.threads = 1;
  const size_t body = size_t{4} << 20;
  Serving serving(gate, /*timeout_seconds=*/1, std::string(body, 'z'));
  const int slow = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(slow, 0);
  int small = 4096;
  setsockopt(slow, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  timeval bound{60, 0};
  setsockopt(slow, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof(bound));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(serving.port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(slow, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  Send(slow, kRequest);
  size_t got = 0;
  bool cut = false;
  std::thread reader([&] {
    char buffer[4096];
    for (int i = 0; i < 400; ++i) {  // 4 KiB every 50 ms: 80 KiB/s, at most 20 s of it
      const ssize_t n = read(slow, buffer, sizeof(buffer));
      if (n <= 0) {
        cut = true;
        break;
      }
      got += static_cast<size_t>(n);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  auto r = serving.Client().Get("/hi");  // the one thread is free
  reader.join();
  close(slow);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_TRUE(cut);
  EXPECT_LT(got, body);
}

// A request with a body the handlers may not have read ends its connection after the answer.
TEST(GatedHttpServerTest, ARequestWithABodyEndsItsConnection) {
  Serving serving(HttpGateOptions{});
  const int fd = Dial(serving.port());
  ASSERT_GE(fd, 0);
  Send(fd, "GET /hi HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
  bool closed = false;
  const std::string answer = ReadToEnd(fd, &closed);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  EXPECT_TRUE(closed);
  close(fd);
}

// Stopping while clients trickle and others are kept alive closes them all at once (their
// deadlines are far away).
TEST(GatedHttpServerTest, StoppingClosesEveryConnection) {
  Serving serving(HttpGateOptions{}, /*timeout_seconds=*/600);
  const int kept = Dial(serving.port(), /*bound_seconds=*/30);
  ASSERT_GE(kept, 0);
  Send(kept, kRequest);
  ASSERT_EQ(ReadAnswers(kept, 1).rfind("HTTP/1.1 200", 0), 0u);
  const int partial = Dial(serving.port(), /*bound_seconds=*/30);
  ASSERT_GE(partial, 0);
  Send(partial, "GET /hi HTTP/1.1\r\n");
  serving.Stop();
  for (int fd : {kept, partial}) {
    bool closed = false;
    EXPECT_EQ(ReadToEnd(fd, &closed), "");
    EXPECT_TRUE(closed);
    close(fd);
  }
}

}  // namespace
}  // namespace pathways
