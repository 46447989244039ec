#include "compute/modelled_executable.h"

#include <sys/prctl.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "collective/collective.h"
#include "core/status_macros.h"

namespace pathways {
namespace {

constexpr const char* kCollectives[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                       "roll"};

// The mesh axes the body's rendezvous spans, or nullopt when the body calls no collective.
// Built-in collectives are named "kernel@axes" (no '@': every axis); TorchScript calls them as
// `pathways.<collective>`, over axes this does not parse, so its shards meet over every axis: at
// least as strict as what the body would do.
std::optional<std::string> RendezvousAxes(const FunctionBody& body) {
  if (body.kind == FunctionBody::Kind::kBuiltin) {
    const size_t at = body.name.find('@');
    const absl::string_view kernel = absl::string_view(body.name).substr(0, at);
    for (const char* c : kCollectives) {
      if (absl::StartsWith(kernel, c)) return at == std::string::npos ? "" : body.name.substr(at + 1);
    }
    return std::nullopt;
  }
  for (const char* c : kCollectives) {
    if (body.source.find(absl::StrCat("pathways.", c)) != std::string::npos) return "";
  }
  return std::nullopt;
}

int64_t MonotonicNanos() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t{now.tv_sec} * 1'000'000'000 + now.tv_nsec;
}

// The most a modelled kernel's thread wakes before its end to spin the rest (see SleepTight), and
// how far one wake-up moves that.
constexpr int64_t kMaxEarlyNanos = 100'000;
constexpr int64_t kEarlyStepNanos = 2'000;

// Holds the calling thread for `cost`, and not much longer. The kernel's timer wakes a sleeping
// thread late: 40-50 µs at the median on this project's VM at 1 µs timer slack (the default
// 50 µs slack adds its own), which made every modelled 1 ms kernel 4-5% long, and a chain of them
// 0.91-0.94 of its limit on an idle machine. So the thread sleeps until the end less an estimate
// of the 10th percentile of its wake-ups' lateness, then spins on the clock to the end: it never
// ends early, it spins in about one kernel in ten, and then for no longer than that estimate.
// The estimate moves by a step per wake-up (up by a tenth of it when the wake-up was later, down
// by nine tenths when earlier), so a loaded machine's run-queue waits raise it only slowly, and
// never past kMaxEarlyNanos.
void SleepTight(absl::Duration cost) {
  thread_local bool slack_set = false;
  thread_local int64_t early_ns = -1;  // -1: no wake-up seen yet
  if (!slack_set) {
    (void)prctl(PR_SET_TIMERSLACK, 1000UL);  // best effort: without it kernels run a little long
    slack_set = true;
  }
  const int64_t start = MonotonicNanos();
  const int64_t end = start + absl::ToInt64Nanoseconds(cost);
  const int64_t wake = end - std::max<int64_t>(early_ns, 0);
  if (wake > start) {
    const timespec at{static_cast<time_t>(wake / 1'000'000'000), static_cast<long>(wake % 1'000'000'000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, nullptr) == EINTR) {
    }
    const int64_t late = std::clamp<int64_t>(MonotonicNanos() - wake, 0, kMaxEarlyNanos);
    if (early_ns < 0) {
      early_ns = late;
    } else if (late > early_ns) {
      early_ns = std::min(kMaxEarlyNanos, early_ns + kEarlyStepNanos / 10);
    } else {
      early_ns = std::max<int64_t>(0, early_ns - kEarlyStepNanos * 9 / 10);
    }
  }
  while (MonotonicNanos() < end) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

class ModelledExecutable final : public Executable {
 public:
  ModelledExecutable(std::string name, absl::Duration cost, std::optional<std::string> rendezvous_axes)
      : name_(std::move(name)), cost_(cost), rendezvous_axes_(std::move(rendezvous_axes)) {}
  const std::string& name() const override { return name_; }

  absl::Status Run(absl::Span<const DeviceBuffer* const> /*inputs*/,
                   absl::Span<DeviceBuffer* const> outputs) const override {
    if (cost_ > absl::ZeroDuration()) SleepTight(cost_);
    if (rendezvous_axes_.has_value()) PW_RETURN_IF_ERROR(MeetGang(*rendezvous_axes_));
    for (DeviceBuffer* out : outputs) std::memset(out->data(), 0, static_cast<size_t>(out->byte_size()));
    return absl::OkStatus();
  }

 private:
  absl::Status MeetGang(const std::string& axes) const {
    collective::ShardCollectives* shard = collective::ShardCollectives::Current();
    if (shard == nullptr) return absl::OkStatus();  // run outside a gang: nobody to meet
    auto size = shard->GroupSize(axes);
    if (!size.ok()) {
      return absl::Status(size.status().code(), absl::StrCat("function '", name_, "': ", size.status().message()));
    }
    if (*size <= 1) return absl::OkStatus();
    const float one = 1;
    float sum = 0;
    collective::CollectiveCall call;
    call.count = 1;
    call.in = reinterpret_cast<const char*>(&one);
    call.out = reinterpret_cast<char*>(&sum);
    absl::Status met = shard->Run(axes, call);
    if (!met.ok()) {
      return absl::Status(met.code(), absl::StrCat("function '", name_, "' failed in a collective: ", met.message()));
    }
    return absl::OkStatus();
  }

  const std::string name_;
  const absl::Duration cost_;
  const std::optional<std::string> rendezvous_axes_;
};

}  // namespace

absl::Duration CostModel::CostOf(const std::string& display_name) const {
  if (auto it = by_function.find(display_name); it != by_function.end()) return it->second;
  if (const size_t at = display_name.find('@'); at != std::string::npos) {
    if (auto it = by_function.find(display_name.substr(0, at)); it != by_function.end()) return it->second;
  }
  return default_cost;
}

absl::StatusOr<CostModel> ParseCostModel(const std::string& text) {
  CostModel model;
  if (text.empty()) return model;
  // An hour bounds a modelled kernel: longer is a typo (a device would sit on it that long).
  constexpr int64_t kMaxMicros = int64_t{3600} * 1000 * 1000;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    const size_t eq = entry.rfind('=');
    int64_t micros = -1;
    if (eq == absl::string_view::npos || eq == 0 || !absl::SimpleAtoi(entry.substr(eq + 1), &micros) || micros < 0 ||
        micros > kMaxMicros) {
      return absl::InvalidArgumentError(absl::StrCat("modelled cost '", entry,
                                                     "' is not NAME=MICROSECONDS (0 to 3600000000; NAME * for "
                                                     "every other function)"));
    }
    const std::string name(entry.substr(0, eq));
    if (name == "*") {
      model.default_cost = absl::Microseconds(micros);
    } else {
      model.by_function[name] = absl::Microseconds(micros);
    }
  }
  return model;
}

absl::StatusOr<std::shared_ptr<const Executable>> CompileModelled(const FunctionBody& body,
                                                                  std::shared_ptr<const CostModel> costs) {
  PW_RETURN_IF_ERROR(ValidateFunctionBody(body));
  if (body.kind == FunctionBody::Kind::kBuiltin) {
    const std::vector<std::string> known = BuiltinKernelNames();
    const std::string kernel = body.name.substr(0, body.name.find('@'));
    if (std::find(known.begin(), known.end(), kernel) == known.end()) {
      return absl::NotFoundError(
          absl::StrCat("unknown built-in kernel '", kernel, "'; known: ", absl::StrJoin(known, ", ")));
    }
  }
  const std::string name = body.DisplayName();
  return std::make_shared<ModelledExecutable>(name, costs->CostOf(name), RendezvousAxes(body));
}

}  // namespace pathways
