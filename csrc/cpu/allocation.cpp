// Radius allocation on the CPU, float64, one thread (the vectors hold one entry per block).
//
// GEAR rule:  s_b <- beta s_b + (1 - beta) e_b;   r_b = rho s_b / ||s||_2 (0 when s = 0);   scale_b = r_b / (sqrt(e_b) + delta)
// SAM rule:   scale_b = rho / (sqrt(sum_j e_j) + delta);   r_b = rho sqrt(e_b) / sqrt(sum_j e_j) (0 when e = 0)

#include <cmath>

#include "../gearsam.h"

namespace gearsam::cpu {

void allocate(const at::Tensor& energy, const at::Tensor& ema, const at::Tensor& scale, const at::Tensor& radius,
              bool gear, double rho, double beta, double delta) {
  const int64_t n = energy.numel();
  const double* e = energy.const_data_ptr<double>();
  double* s = ema.mutable_data_ptr<double>();
  double* out_scale = scale.mutable_data_ptr<double>();
  double* out_radius = radius.mutable_data_ptr<double>();
  double sum = 0.0;
  if (gear) {
    for (int64_t b = 0; b < n; ++b) {
      s[b] = beta * s[b] + (1.0 - beta) * e[b];
      sum += s[b] * s[b];
    }
  } else {
    for (int64_t b = 0; b < n; ++b) sum += e[b];
  }
  const double norm = std::sqrt(sum);
  for (int64_t b = 0; b < n; ++b) {
    const double root = std::sqrt(e[b]);
    if (gear) {
      out_radius[b] = norm > 0 ? rho * (s[b] / norm) : 0.0;
      out_scale[b] = out_radius[b] / (root + delta);
    } else {
      out_radius[b] = norm > 0 ? rho * (root / norm) : 0.0;
      out_scale[b] = rho / (norm + delta);
    }
  }
}

}  // namespace gearsam::cpu
