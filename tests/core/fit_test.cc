// Least squares, measured curves, medians, the floor of a constant prediction and Kendall's tau
// (core/fit.h).
#include "moeplan/core/fit.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace moeplan {
namespace {

TEST(FitLine, RecoversAnExactLine) {
  // Latency 300 us, 1 GB/s: what a collective sweep fits, over four decades of x.
  std::vector<double> x, y;
  for (double b = 1e4; b <= 1e8; b *= 4) {
    x.push_back(b);
    y.push_back(3e-4 + b / 1e9);
  }
  const LineFit f = fit_line(x, y);
  EXPECT_NEAR(f.intercept, 3e-4, 1e-12);
  EXPECT_NEAR(f.slope, 1e-9, 1e-18);
  EXPECT_NEAR(f.r_squared, 1.0, 1e-12);
  EXPECT_EQ(f.points, static_cast<int64_t>(x.size()));
}

TEST(FitLine, MinimisesSquaredResiduals) {
  // Points (0,0) (1,1) (2,1) (3,3): Sxy = 4.5, Sxx = 5, so slope 0.9 and intercept
  // 1.25 - 0.9 * 1.5 = -0.1 (normal equations by hand).
  const LineFit f = fit_line({0, 1, 2, 3}, {0, 1, 1, 3});
  EXPECT_NEAR(f.slope, 0.9, 1e-12);
  EXPECT_NEAR(f.intercept, -0.1, 1e-12);
  // Residuals 0.1, 0.2, -0.7, 0.4 (squares 0.70); total sum of squares 4.75.
  EXPECT_NEAR(f.r_squared, 1.0 - 0.70 / 4.75, 1e-12);
}

TEST(FitLine, ConstantXGivesTheMean) {
  const LineFit f = fit_line({2, 2, 2}, {1, 2, 6});
  EXPECT_EQ(f.slope, 0.0);
  EXPECT_DOUBLE_EQ(f.intercept, 3.0);
  const LineFit none = fit_line({}, {});
  EXPECT_EQ(none.points, 0);
}

TEST(CurveAt, InterpolatesAndExtendsTheEndSegments) {
  const CurvePoints c{{256, 1.0}, {512, 3.0}, {1024, 4.0}};
  EXPECT_DOUBLE_EQ(curve_at(c, 256), 1.0);
  EXPECT_DOUBLE_EQ(curve_at(c, 384), 2.0);
  EXPECT_DOUBLE_EQ(curve_at(c, 768), 3.5);
  EXPECT_DOUBLE_EQ(curve_at(c, 2048), 6.0);  // the last segment, extended
  EXPECT_DOUBLE_EQ(curve_at(c, 192), 0.5);   // the first segment, extended
  EXPECT_DOUBLE_EQ(curve_at(c, 64), 0.0);    // ... and clamped at zero
  EXPECT_DOUBLE_EQ(curve_at({{10, 7.0}}, 1e6), 7.0);
  EXPECT_DOUBLE_EQ(curve_at({}, 5), 0.0);
}

TEST(Median, OddAndEven) {
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2.0);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(median({}), 0.0);
}

TEST(MedianErrorFloor, NoSingleValueComesNearer) {
  // 1, 2, 3: the pair 2, 3 is the tightest half; 2.4 is within 20% of both.
  EXPECT_NEAR(median_error_floor({3, 1, 2}), 0.2, 1e-12);
  EXPECT_EQ(median_error_floor({}), 0);
  EXPECT_EQ(median_error_floor({5, 5, 5}), 0);
  // Against a fine scan of single values, on odd and even counts of spread-out times: the floor is
  // never beaten, and for an odd count some value reaches it.
  std::mt19937 rng(7);
  std::lognormal_distribution<double> time(0.0, 0.2);
  for (int n : {5, 6, 31, 40}) {
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) x = time(rng);
    const double floor = median_error_floor(v);
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i <= 20000; ++i) {
      const double c = 0.3 + 2.7 * i / 20000.0;
      std::vector<double> errors;
      for (double x : v) errors.push_back(std::abs(c / x - 1));
      best = std::min(best, median(errors));
    }
    EXPECT_LE(floor, best + 1e-9) << n;
    if (n % 2 == 1) {
      EXPECT_NEAR(floor, best, 1e-3) << n;
    }
  }
}

TEST(KendallTau, KnownRankings) {
  EXPECT_DOUBLE_EQ(kendall_tau({1, 2, 3, 4}, {10, 20, 30, 40}), 1.0);
  EXPECT_DOUBLE_EQ(kendall_tau({1, 2, 3, 4}, {4, 3, 2, 1}), -1.0);
  // One adjacent swap among 4 items: 5 concordant, 1 discordant pairs.
  EXPECT_NEAR(kendall_tau({1, 2, 3, 4}, {1, 3, 2, 4}), 4.0 / 6.0, 1e-12);
  // tau-b with a tie on one side (the first pair in a): 4 concordant, 1 discordant, 1 tied in
  // a only: (C - D) / sqrt((C + D + Ta)(C + D + Tb)) = 3 / sqrt(6 * 5).
  EXPECT_NEAR(kendall_tau({1, 1, 2, 3}, {1, 2, 4, 3}), 3.0 / std::sqrt(30.0), 1e-12);
  EXPECT_DOUBLE_EQ(kendall_tau({1}, {2}), 0.0);
  EXPECT_DOUBLE_EQ(kendall_tau({1, 1, 1}, {1, 2, 3}), 0.0);
}

}  // namespace
}  // namespace moeplan

namespace moeplan {
namespace {

TEST(FitLineRelative, SmallTimesWeighAsMuchAsLargeOnesAndOutliersGo) {
  // 300 us + bytes / 1 GB/s over 16 KiB .. 16 MiB, with one size five times slower.
  std::vector<double> x, y;
  for (double b = 16384; b <= 16777216; b *= 2) {
    x.push_back(b);
    y.push_back(3e-4 + b / 1e9);
  }
  y[8] *= 5;  // 4 MiB
  const LineFit plain = fit_line(x, y);
  const LineFit robust = fit_line_relative(x, y);
  EXPECT_EQ(robust.points, static_cast<int64_t>(x.size()) - 1);
  EXPECT_NEAR(robust.intercept, 3e-4, 1e-9);
  EXPECT_NEAR(robust.slope, 1e-9, 1e-15);
  // Plain least squares is pulled by the slow size: its latency is far off.
  EXPECT_GT(std::abs(plain.intercept - 3e-4), 1e-3);
  // Without outliers nothing is dropped.
  y[8] /= 5;
  EXPECT_EQ(fit_line_relative(x, y).points, static_cast<int64_t>(x.size()));
}

}  // namespace
}  // namespace moeplan
