// Progress of a long-running command on one line: a bar redrawn in place when the stream is a
// terminal. Off a terminal it prints plain lines (about every 5%) or nothing, as the command
// chooses: `train` logs its steps either way, benchmarks keep redirected output to their tables.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace pathways {

class Progress {
 public:
  enum class OffTerminal { kPlainLines, kSilent };
  // `total` units of work, counted from `first` + 1 (a resumed run goes on from where it was).
  Progress(std::string label, int64_t total, FILE* stream = stdout, OffTerminal off = OffTerminal::kPlainLines,
           int64_t first = 0);
  ~Progress();  // ends a bar left unfinished, so the next line starts clean
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // `done` units of `total` are done; `detail` follows the count (loss, rates, what runs now).
  void Show(int64_t done, const std::string& detail = "");
  // Wipes a bar drawn on a terminal, for a line of other output; the next Show draws it again.
  void Clear();
  bool terminal() const { return terminal_; }

  // What Show draws on a terminal (without the leading carriage return): for tests.
  static std::string Bar(const std::string& label, int64_t done, int64_t total, const std::string& detail);

 private:
  const std::string label_;
  const int64_t total_;
  FILE* const stream_;
  const OffTerminal off_;
  const int64_t first_;
  const bool terminal_;
  bool open_ = false;  // a bar is drawn and its line not ended
};

}  // namespace pathways
