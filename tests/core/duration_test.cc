#include "moeplan/core/duration.h"

#include <gtest/gtest.h>

#include "moeplan/core/errors.h"

namespace moeplan {
namespace {

TEST(Duration, ReadsSecondsUnitsAndSlurmForms) {
  EXPECT_EQ(parse_duration_seconds("3600", "f"), 3600);
  EXPECT_EQ(parse_duration_seconds("90s", "f"), 90);
  EXPECT_EQ(parse_duration_seconds("45m", "f"), 45 * 60);
  EXPECT_EQ(parse_duration_seconds("4h", "f"), 4 * 3600);
  EXPECT_EQ(parse_duration_seconds("2d", "f"), 2 * 86400);
  EXPECT_EQ(parse_duration_seconds("1h30m", "f"), 5400);
  EXPECT_EQ(parse_duration_seconds("1d2h3m4s", "f"), 86400 + 7200 + 180 + 4);
  EXPECT_EQ(parse_duration_seconds("05:30", "f"), 330);  // MM:SS
  EXPECT_EQ(parse_duration_seconds("03:50:00", "f"), 3 * 3600 + 50 * 60);
  EXPECT_EQ(parse_duration_seconds("2-00:00:10", "f"), 2 * 86400 + 10);
}

TEST(Duration, RefusesWhatIsNoDurationNamingTheField) {
  for (const char* bad : {"", "0", "0s", "-5", "4x", "h", "30m1h", "1h1h", "1.5h", "12:60", "1:2:3:4", "1-", "-1:00",
                          "99999999999", "3 h", "1h30"}) {
    try {
      parse_duration_seconds(bad, "--stop-after");
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const InputError& e) {
      EXPECT_EQ(e.origin(), "--stop-after") << bad;
    }
  }
}

}  // namespace
}  // namespace moeplan
