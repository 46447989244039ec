#include "core/logging.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TEST(LoggingTest, LevelsParseByNameOrNumberAndOthersAreNamedInTheError) {
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("warning"), LogLevel::kWarning);
  EXPECT_EQ(*ParseLogLevel("3"), LogLevel::kError);
  EXPECT_EQ(*ParseLogLevel("INFO"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("warn"), LogLevel::kWarning);
  auto bad = ParseLogLevel("verbose");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'verbose'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("debug, info, warning, error"), std::string::npos);
  EXPECT_FALSE(ParseLogLevel("").ok());
  EXPECT_FALSE(ParseLogLevel("4").ok());
}

TEST(LoggingTest, ALineCarriesItsLevelAUtcTimestampAndWhereItCameFrom) {
  // 2026-12-02T13:11:08.042Z
  EXPECT_EQ(FormatLogLine(LogLevel::kWarning, "/src/worker/worker.cc", 160, "hello", 1796217068042),
            "W 2026-12-02T13:11:08.042Z worker.cc:160] hello");
}

TEST(LoggingTest, LinesBelowTheLevelAreDropped) {
  const LogLevel before = MinLogLevel();
  SetMinLogLevel(LogLevel::kError);
  int evaluated = 0;
  PW_LOG(Info) << ++evaluated;  // not even streamed
  EXPECT_EQ(evaluated, 0);
  PW_LOG(Error) << ++evaluated;
  EXPECT_EQ(evaluated, 1);
  SetMinLogLevel(before);
}

}  // namespace
}  // namespace pathways
