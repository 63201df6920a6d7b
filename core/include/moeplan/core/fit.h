#pragma once
// Small statistics shared by calibration and validation: least-squares lines, piecewise-linear
// curves of measured points, medians and Kendall's rank correlation.

#include <cstdint>
#include <utility>
#include <vector>

namespace moeplan {

// y = intercept + slope * x, fitted by least squares.
struct LineFit {
  double intercept = 0;
  double slope = 0;
  double r_squared = 0;  // 1 - residual / total sum of squares; 1 when y does not vary
  int64_t points = 0;
};

// Least squares over (x[i], y[i]); needs at least two points with different x (else slope 0
// and intercept the mean). Solved with Eigen's QR, which stays accurate when x spans decades.
LineFit fit_line(const std::vector<double>& x, const std::vector<double>& y);

// The same line fitted to relative errors, (y - a - b x) / y, which suits times that span
// decades (a latency-bound small message weighs as much as a large one). Points more than
// `outlier` (relative) off the line are dropped one at a time, the worst first, while at least
// three quarters of them remain; `points` counts the ones kept, r_squared is over them.
LineFit fit_line_relative(const std::vector<double>& x, const std::vector<double>& y, double outlier = 0.5);

// A measured curve: y at increasing x, read in between by linear interpolation and beyond the
// ends by extending the first or last segment (never below zero). One point: a constant.
using CurvePoints = std::vector<std::pair<double, double>>;
double curve_at(const CurvePoints& points, double x);

double median(std::vector<double> values);
// The q-quantile (0 <= q <= 1) by linear interpolation between the sorted values (index
// q (n - 1)): the median at q = 0.5; 0 for none.
double quantile(std::vector<double> values, double q);

// The lower quartile: the value a quarter of the way up the sorted values (index (n - 1) / 4,
// no interpolation), as calibration keeps a figure over its passes; 0 for none.
double lower_quartile(std::vector<double> values);

// The least median |c / x - 1| that one value c can reach over positive `values`: how near a
// prediction that is the same for every item can come, whatever it is (0 for none). Exact for an
// odd count; for an even one, the narrowest relative band around one value that holds half of
// them, which is no more than it.
double median_error_floor(std::vector<double> values);

// Kendall's tau-b between two rankings of the same items (ties counted as neither concordant
// nor discordant); 0 when fewer than two items or either side is constant.
double kendall_tau(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace moeplan
