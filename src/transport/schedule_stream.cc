#include "transport/schedule_stream.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/socket_util.h"
#include "transport/auth.h"

namespace pathways {
namespace {

// A frame that stops halfway for this long: the other side is frozen or gone.
constexpr absl::Duration kFrameSilence = absl::Seconds(30);

// The answers of one schedule stream (ServeScheduleStream), written in their requests' order.
// Shared with the answers' continuations, which may run after the stream is served.
class AnswerQueue : public std::enable_shared_from_this<AnswerQueue> {
 public:
  explicit AnswerQueue(int fd) : fd_(fd) {}

  void Add(Future<Unit> answer) {
    {
      absl::MutexLock lock(&mu_);
      waiting_.push_back(answer);
    }
    answer.OnReady([self = shared_from_this()](const absl::StatusOr<Unit>&) { self->Drain(); });
  }
  void StopReading() {
    absl::MutexLock lock(&mu_);
    reading_ = false;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // The writer thread: writes what the completing threads could not, until reading stopped and
  // every answer is out (or the connection broke, or the listener stops).
  void WriteUntilDone(const StreamListener& listener) {
    while (true) {
      std::string out;
      {
        absl::MutexLock lock(&mu_);
        auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return broken_ || !unsent_.empty() || (!reading_ && waiting_.empty());
        };
        if (!mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1))) {
          if (listener.stopping()) return;
          continue;
        }
        if (broken_ || unsent_.empty()) return;
        out.swap(unsent_);
        writing_ = true;
      }
      const bool sent =
          TransferAll(fd_, out.data(), out.size(), true, absl::Now() + kFrameSilence, "schedule answer").ok();
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!sent) {
        broken_ = true;
        shutdown(fd_, SHUT_RDWR);  // the reader stops too
        return;
      }
    }
  }

 private:
  // The answers at the front that are ready, framed, then sent without waiting when nothing is
  // being written; what the socket does not take goes to the writer thread.
  void Drain() {
    absl::MutexLock lock(&mu_);
    while (!waiting_.empty() && waiting_.front().IsReady()) {
      absl::StrAppend(&unsent_, StreamStatusFrame(waiting_.front().Await().status()));
      waiting_.pop_front();
    }
    if (unsent_.empty() || writing_ || broken_ || closed_) return;
    size_t done = 0;
    while (done < unsent_.size()) {
      const ssize_t n = send(fd_, unsent_.data() + done, unsent_.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        break;  // full, or broken: the writer thread finds out
      }
    }
    unsent_.erase(0, done);
  }

  const int fd_;
  absl::Mutex mu_;
  std::deque<Future<Unit>> waiting_ ABSL_GUARDED_BY(mu_);  // in the requests' order
  std::string unsent_ ABSL_GUARDED_BY(mu_);                // answers framed, not yet sent
  bool writing_ ABSL_GUARDED_BY(mu_) = false;              // the writer thread is sending
  bool reading_ ABSL_GUARDED_BY(mu_) = true;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // the connection may be closed: nothing more is sent
};

}  // namespace

struct ScheduleStream::State {
  State(std::string controller, int fd) : controller(std::move(controller)), fd(fd) {
    wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  }
  ~State() {
    close(fd);
    if (wake_fd >= 0) close(wake_fd);
  }
  // Fails what waits (after the lock is released: continuations may schedule again).
  std::deque<Promise<Unit>> BreakLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (broken.ok()) broken = why;
    shutdown(fd, SHUT_RDWR);  // the reader sees it at once
    std::deque<Promise<Unit>> failed;
    failed.swap(waiting);
    return failed;
  }
  void Break(const absl::Status& why) {
    std::deque<Promise<Unit>> failed;
    absl::Status broken_by;
    {
      absl::MutexLock lock(&mu);
      failed = BreakLocked(why);
      broken_by = broken;
    }
    for (Promise<Unit>& p : failed) p.Set(broken_by);
  }

  const std::string controller;
  const int fd;
  int wake_fd = -1;
  absl::Mutex write_mu;  // a request's place among the waiting and its bytes go together
  absl::Mutex mu;
  std::deque<Promise<Unit>> waiting ABSL_GUARDED_BY(mu);
  absl::Status broken ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::unique_ptr<ScheduleStream>> ScheduleStream::Connect(const std::string& controller,
                                                                         const std::string& ip, int port,
                                                                         absl::Duration timeout,
                                                                         const std::optional<std::string>& token) {
  const std::string what = absl::StrCat("schedule stream to controller ", controller);
  absl::StatusOr<int> fd = DialStream(what, ip, port, kScheduleStreamMagic, TokenOr(token), timeout);
  if (!fd.ok()) return fd.status();
  absl::StatusOr<rpc::StreamHeader> admitted = ReadStreamHeader(*fd, timeout, what);
  absl::Status s = admitted.ok() ? HeaderStatus(*admitted) : admitted.status();
  if (!s.ok()) {
    close(*fd);
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }
  return std::unique_ptr<ScheduleStream>(new ScheduleStream(std::make_shared<State>(controller, *fd)));
}

ScheduleStream::ScheduleStream(std::shared_ptr<State> state) : state_(std::move(state)) {
  reader_ = std::thread([state = state_] {
    NameThisThread("sched-reader");
    ReadLoop(state);
  });
}

ScheduleStream::~ScheduleStream() {
  state_->Break(absl::CancelledError(absl::StrCat("the schedule stream to controller ", state_->controller, " closed")));
  const uint64_t one = 1;
  (void)!write(state_->wake_fd, &one, sizeof(one));
  if (reader_.get_id() == std::this_thread::get_id()) {
    reader_.detach();  // going from one of its continuations: it ends once that returns
  } else {
    reader_.join();
  }
}

bool ScheduleStream::broken() {
  absl::MutexLock lock(&state_->mu);
  return !state_->broken.ok();
}

namespace {

constexpr char kNeverSent[] = "pathways.dev/schedule-never-sent";

absl::Status MarkNeverSent(absl::Status s) {
  s.SetPayload(kNeverSent, absl::Cord());
  return s;
}

}  // namespace

bool ScheduleStream::NeverSent(const absl::Status& s) { return s.GetPayload(kNeverSent).has_value(); }

Future<Unit> ScheduleStream::Schedule(const rpc::ScheduleRequest& request) {
  State& st = *state_;
  const size_t bytes = request.ByteSizeLong();
  if (bytes > kMaxScheduleRequestBytes) {
    return Future<Unit>::Ready(absl::InvalidArgumentError(absl::StrCat(
        "Schedule on controller ", st.controller, ": a request of ", bytes, " bytes (at most ",
        kMaxScheduleRequestBytes, "): schedule fewer runs at a time")));
  }
  std::string frame = EncodeStreamU32(static_cast<uint32_t>(bytes));
  request.AppendToString(&frame);
  Future<Unit> answer;
  std::deque<Promise<Unit>> failed;
  absl::Status broken_by;
  {
    absl::MutexLock write(&st.write_mu);
    {
      absl::MutexLock lock(&st.mu);
      if (!st.broken.ok()) return Future<Unit>::Ready(MarkNeverSent(st.broken));
      st.waiting.emplace_back();
      answer = st.waiting.back().future();
    }
    absl::Status sent = TransferWhileMoving(st.fd, frame.data(), frame.size(), true, kFrameSilence,
                                            absl::StrCat("schedule stream to controller ", st.controller));
    if (!sent.ok()) {
      // Broken before the next writer may append to a half-written frame.
      absl::MutexLock lock(&st.mu);
      failed = st.BreakLocked(absl::UnavailableError(sent.message()));
      broken_by = st.broken;
    }
  }
  // Continuations run without the locks. This request's frame is the last one waiting, and was
  // not written whole: the controller cannot have read it. Those before it may have been read.
  for (size_t i = 0; i < failed.size(); ++i) {
    failed[i].Set(i + 1 == failed.size() ? MarkNeverSent(broken_by) : broken_by);
  }
  return answer;
}

void ScheduleStream::ReadLoop(const std::shared_ptr<State>& state) {
  State& st = *state;
  const std::string what = absl::StrCat("schedule stream to controller ", st.controller);
  absl::Status why;
  while (why.ok()) {
    // An answer may be long in coming (a scheduler holding the client back): no bound here.
    pollfd polled[2] = {{st.fd, POLLIN, 0}, {st.wake_fd, POLLIN, 0}};
    const int ready = poll(polled, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0 || polled[1].revents != 0) {
      why = absl::CancelledError(absl::StrCat(what, ": closed"));
      break;
    }
    absl::StatusOr<rpc::StreamHeader> header = ReadStreamHeader(st.fd, kFrameSilence, what);
    if (!header.ok()) {
      why = absl::UnavailableError(absl::StrCat(header.status().message(), " (the controller went away or restarted)"));
      break;
    }
    Promise<Unit> promise;
    {
      absl::MutexLock lock(&st.mu);
      if (st.waiting.empty()) {
        why = absl::DataLossError(absl::StrCat(what, ": an answer to no request"));
        break;
      }
      promise = std::move(st.waiting.front());
      st.waiting.pop_front();
    }
    const absl::Status s = HeaderStatus(*header);
    // Named as the unary call names it, so errors read the same whichever way a request went.
    if (s.ok()) {
      promise.Set(Unit{});
    } else {
      promise.Set(absl::Status(s.code(), absl::StrCat("Schedule on controller ", st.controller, ": ", s.message())));
    }
  }
  st.Break(why);
}

void ServeScheduleStream(int fd, const StreamListener& listener,
                         const std::function<Future<Unit>(const rpc::ScheduleRequest&)>& submit) {
  std::string admitted = StreamStatusFrame(absl::OkStatus());
  if (!TransferAll(fd, admitted.data(), admitted.size(), true, absl::Now() + kFrameSilence, "admission").ok()) return;
  // Answers go out in the requests' order, each once its runs reach their hosts. The thread that
  // completes an answer writes it, with what completed before it, when the socket takes it at
  // once (a few bytes, to a client that reads them); the rest is left to a writer thread, which
  // also waits for the last answers once reading stops. Reading the next request never waits for
  // the previous answer. Waking a thread to write each answer cost two wake-ups per request.
  auto answers = std::make_shared<AnswerQueue>(fd);
  std::thread writer([&] {
    NameThisThread("sched-answers");
    answers->WriteUntilDone(listener);
  });
  auto answer = [&](Future<Unit> f) { answers->Add(std::move(f)); };
  std::string body;
  while (true) {
    // No idle bound: a client keeps its stream while it lives (its lease says when it is gone,
    // and the kernel closes a dead process's connection).
    pollfd polled[2] = {{fd, POLLIN, 0}, {listener.wake_fd(), POLLIN, 0}};
    const int ready = poll(polled, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0 || polled[1].revents != 0 || (polled[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) break;
    char length[4];
    if (!TransferWhileMoving(fd, length, 4, false, kFrameSilence, "schedule request").ok()) break;
    const uint32_t bytes = DecodeStreamU32(length);
    if (bytes > kMaxScheduleRequestBytes) {
      answer(Future<Unit>::Ready(absl::InvalidArgumentError(
          absl::StrCat("a schedule request of ", bytes, " bytes (at most ", kMaxScheduleRequestBytes, ")"))));
      break;  // the stream is at an unknown place: it closes after this answer
    }
    if (!ReadFrameWhileMoving(fd, body, bytes, kFrameSilence, "schedule request").ok()) break;
    rpc::ScheduleRequest request;
    if (!request.ParseFromString(body)) {
      answer(Future<Unit>::Ready(absl::InvalidArgumentError("a schedule request that does not parse")));
      continue;  // framed: the next request starts right after it
    }
    answer(submit(request));
  }
  answers->StopReading();
  writer.join();
  answers->Close();  // answers completed from now on are not written: the connection is going
}

}  // namespace pathways
