#include "moeplan/core/fit.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <limits>

namespace moeplan {

LineFit fit_line(const std::vector<double>& x, const std::vector<double>& y) {
  LineFit f;
  const auto n = static_cast<Eigen::Index>(std::min(x.size(), y.size()));
  f.points = n;
  if (n == 0) return f;
  Eigen::MatrixXd a(n, 2);
  Eigen::VectorXd b(n);
  for (Eigen::Index i = 0; i < n; ++i) {
    a(i, 0) = 1.0;
    a(i, 1) = x[static_cast<size_t>(i)];
    b(i) = y[static_cast<size_t>(i)];
  }
  const double mean = b.mean();
  const bool x_varies = (a.col(1).array() != a(0, 1)).any();
  if (!x_varies) {
    f.intercept = mean;
  } else {
    const Eigen::Vector2d c = a.colPivHouseholderQr().solve(b);
    f.intercept = c(0);
    f.slope = c(1);
  }
  const double total = (b.array() - mean).square().sum();
  const double residual = (b - (a.col(0) * f.intercept + a.col(1) * f.slope)).squaredNorm();
  f.r_squared = total > 0 ? 1.0 - residual / total : 1.0;
  return f;
}

LineFit fit_line_relative(const std::vector<double>& x, const std::vector<double>& y, double outlier) {
  std::vector<size_t> kept;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i)
    if (y[i] > 0) kept.push_back(i);
  const size_t least = (kept.size() * 3 + 3) / 4;
  while (true) {
    const auto n = static_cast<Eigen::Index>(kept.size());
    if (n < 2) {
      std::vector<double> kx, ky;
      for (size_t i : kept) {
        kx.push_back(x[i]);
        ky.push_back(y[i]);
      }
      return fit_line(kx, ky);
    }
    // Rows divided by y: minimises the relative residuals.
    Eigen::MatrixXd a(n, 2);
    Eigen::VectorXd b(n);
    for (Eigen::Index r = 0; r < n; ++r) {
      const size_t i = kept[static_cast<size_t>(r)];
      a(r, 0) = 1.0 / y[i];
      a(r, 1) = x[i] / y[i];
      b(r) = 1.0;
    }
    const Eigen::Vector2d c = a.colPivHouseholderQr().solve(b);
    size_t worst = 0;
    double worst_error = -1;
    for (size_t r = 0; r < kept.size(); ++r) {
      const size_t i = kept[r];
      const double e = std::abs(y[i] - c(0) - c(1) * x[i]) / y[i];
      if (e > worst_error) {
        worst_error = e;
        worst = r;
      }
    }
    if (worst_error > outlier && kept.size() > least) {
      kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(worst));
      continue;
    }
    LineFit f;
    f.intercept = c(0);
    f.slope = c(1);
    f.points = n;
    double mean = 0;
    for (size_t i : kept) mean += y[i];
    mean /= static_cast<double>(n);
    double total = 0, residual = 0;
    for (size_t i : kept) {
      total += (y[i] - mean) * (y[i] - mean);
      residual += (y[i] - c(0) - c(1) * x[i]) * (y[i] - c(0) - c(1) * x[i]);
    }
    f.r_squared = total > 0 ? 1.0 - residual / total : 1.0;
    return f;
  }
}

double curve_at(const CurvePoints& p, double x) {
  if (p.empty()) return 0;
  if (p.size() == 1) return p.front().second;
  size_t hi = 1;
  while (hi + 1 < p.size() && x > p[hi].first) ++hi;
  const auto& [x0, y0] = p[hi - 1];
  const auto& [x1, y1] = p[hi];
  const double t = x1 > x0 ? (x - x0) / (x1 - x0) : 0.0;
  return std::max(0.0, y0 + t * (y1 - y0));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double at = std::clamp(q, 0.0, 1.0) * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(at));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (at - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

double lower_quartile(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 4];
}

double median_error_floor(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  // |c / x - 1| <= e holds for x in [c / (1 + e), c / (1 - e)], a band whose ends are (1 + e) /
  // (1 - e) apart; the median error is e when half of the values lie in it. So the floor is set
  // by the run of half the sorted values with the smallest ratio between its ends.
  const size_t half = (v.size() + 1) / 2;
  double ratio = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i + half <= v.size(); ++i) ratio = std::min(ratio, v[i + half - 1] / v[i]);
  return (ratio - 1) / (ratio + 1);
}

double kendall_tau(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  double concordant = 0, discordant = 0, ties_a = 0, ties_b = 0;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const double da = a[i] - a[j], db = b[i] - b[j];
      if (da == 0 && db == 0) continue;
      if (da == 0) {
        ++ties_a;
      } else if (db == 0) {
        ++ties_b;
      } else if ((da > 0) == (db > 0)) {
        ++concordant;
      } else {
        ++discordant;
      }
    }
  const double denom = std::sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b));
  return denom > 0 ? (concordant - discordant) / denom : 0.0;
}

}  // namespace moeplan
