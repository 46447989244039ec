#include "core/progress.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pathways {

Progress::Progress(std::string label, int64_t total, FILE* stream, OffTerminal off, int64_t first)
    : label_(std::move(label)),
      total_(std::max<int64_t>(1, total)),
      stream_(stream),
      off_(off),
      first_(first),
      terminal_(isatty(fileno(stream)) == 1) {}

Progress::~Progress() {
  if (open_) {
    std::fputc('\n', stream_);
    std::fflush(stream_);
  }
}

void Progress::Clear() {
  if (!open_) return;
  std::fputs("\r\033[K", stream_);
  std::fflush(stream_);
  open_ = false;
}

std::string Progress::Bar(const std::string& label, int64_t done, int64_t total, const std::string& detail) {
  constexpr int64_t kWidth = 30;
  total = std::max<int64_t>(1, total);
  const int64_t filled = std::clamp<int64_t>(kWidth * done / total, 0, kWidth);
  std::string bar = absl::StrCat(label.empty() ? "" : label + " ", "[", std::string(filled, '#'),
                                 std::string(kWidth - filled, '.'), "] ", done, "/", total);
  if (!detail.empty()) absl::StrAppend(&bar, "  ", detail);
  return bar;
}

void Progress::Show(int64_t done, const std::string& detail) {
  done = std::clamp<int64_t>(done, 0, total_);
  if (terminal_) {
    // Clear to the end of the line: a shorter detail must not leave the old one's tail.
    std::fprintf(stream_, "\r  %s\033[K", Bar(label_, first_ + done, first_ + total_, detail).c_str());
    open_ = done < total_;
    if (!open_) std::fputc('\n', stream_);
  } else if (off_ == OffTerminal::kPlainLines &&
             (done == 1 || done == total_ || done % std::max<int64_t>(1, total_ / 20) == 0)) {
    const std::string line = absl::StrCat("  ", label_.empty() ? "" : label_ + " ", first_ + done, "/", first_ + total_,
                                          detail.empty() ? "" : "  ", detail, "\n");
    std::fputs(line.c_str(), stream_);
  }
  std::fflush(stream_);
}

}  // namespace pathways
