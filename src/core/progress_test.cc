#include "core/progress.h"

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace pathways {
namespace {

std::string Contents(FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  for (int c = std::fgetc(f); c != EOF; c = std::fgetc(f)) out += static_cast<char>(c);
  return out;
}

TEST(ProgressTest, TheBarFillsWithTheWorkDone) {
  EXPECT_EQ(Progress::Bar("step", 0, 10, ""), "step [..............................] 0/10");
  EXPECT_EQ(Progress::Bar("step", 5, 10, "loss 1.5"), "step [###############...............] 5/10  loss 1.5");
  EXPECT_EQ(Progress::Bar("", 10, 10, ""), "[##############################] 10/10");
  EXPECT_EQ(Progress::Bar("x", 12, 10, ""), "x [##############################] 12/10");  // overrun: full, not past
}

TEST(ProgressTest, OffATerminalItPrintsAboutTwentyPlainLinesOrNothing) {
  FILE* plain = std::tmpfile();
  ASSERT_NE(plain, nullptr);
  {
    Progress p("step", 100, plain, Progress::OffTerminal::kPlainLines, /*first=*/200);
    EXPECT_FALSE(p.terminal());
    for (int i = 1; i <= 100; ++i) p.Show(i, "loss 2");
  }
  const std::string text = Contents(plain);
  int lines = 0;
  for (char c : text) lines += c == '\n';
  EXPECT_EQ(lines, 21);  // the first, every 5th, the last
  EXPECT_EQ(text.substr(0, text.find('\n')), "  step 201/300  loss 2");
  EXPECT_NE(text.find("  step 300/300  loss 2\n"), std::string::npos);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  std::fclose(plain);

  FILE* silent = std::tmpfile();
  ASSERT_NE(silent, nullptr);
  {
    Progress p("bench", 10, silent, Progress::OffTerminal::kSilent);
    for (int i = 0; i <= 10; ++i) p.Show(i, "2x1 4 B");
  }
  EXPECT_EQ(Contents(silent), "");
  std::fclose(silent);
}

}  // namespace
}  // namespace pathways
