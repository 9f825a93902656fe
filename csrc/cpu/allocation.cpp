// Radius allocation on the CPU, float64, one thread (the vectors hold one entry per block).
//
// The GEAR and SAM rules (EMA, radii, scales; a block whose energy is not finite skipped for the step) are stated
// once, in gearsam_fused/allocation.py (gear_allocate, sam_allocate). Here, as there, ||s||_2 is taken through
// t_b = s_b / max_j s_j, so that squaring tiny or huge float64 scores neither underflows nor overflows.
//
// Capturable: rho from scalars[0] where given; found_inf nonzero gives scale = radius = 0 and leaves the EMA as it
// is. Both are CPU tensors here, read on the host.

#include <algorithm>
#include <cmath>

#include "../gearsam.h"

namespace gearsam::cpu {

void allocate(const at::Tensor& energy, const at::Tensor& ema, const at::Tensor& scale, const at::Tensor& radius,
              bool gear, double rho, double beta, double delta, const DeviceStep& device_step) {
  if (device_step.found_inf.defined() && *device_step.found_inf.const_data_ptr<float>() != 0) {
    scale.zero_();
    radius.zero_();
    return;
  }
  if (device_step.scalars.defined()) rho = *device_step.scalars.const_data_ptr<double>();
  const int64_t n = energy.numel();
  const double* e = energy.const_data_ptr<double>();
  double* s = ema.mutable_data_ptr<double>();
  double* out_scale = scale.mutable_data_ptr<double>();
  double* out_radius = radius.mutable_data_ptr<double>();
  double sum = 0.0;
  double peak = 0.0;
  if (gear) {
    for (int64_t b = 0; b < n; ++b) {
      if (std::isfinite(e[b])) s[b] = beta * s[b] + (1.0 - beta) * e[b];
      peak = std::max(peak, s[b]);
    }
    if (!(peak > 0)) peak = 1.0;  // s = 0: t = 0 and every radius is 0
    for (int64_t b = 0; b < n; ++b) {
      const double t = s[b] / peak;
      sum += t * t;
    }
  } else {
    for (int64_t b = 0; b < n; ++b) sum += e[b];
  }
  const double norm = std::sqrt(sum);
  for (int64_t b = 0; b < n; ++b) {
    const double root = std::sqrt(e[b]);
    const bool finite = std::isfinite(gear ? e[b] : norm);
    if (gear) {
      out_radius[b] = norm > 0 && finite ? rho * ((s[b] / peak) / norm) : 0.0;
      out_scale[b] = finite ? out_radius[b] / (root + delta) : 0.0;
    } else {
      out_radius[b] = norm > 0 && finite ? rho * (root / norm) : 0.0;
      out_scale[b] = finite ? rho / (norm + delta) : 0.0;
    }
  }
}

}  // namespace gearsam::cpu
