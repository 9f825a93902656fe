// F-SAM's ascent on a span of elements (formula and roundings in mix.cpp), shared by its own kernel (mix.cpp) and the
// one that takes the energies of the new gradient in the same read (energy.cpp).
#pragma once

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace gearsam::cpu {
namespace friendly {

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_INLINE void loop(scalar_t* g, scalar_t* m, int64_t n, compute_t s, compute_t w) {
  const bool small = std::abs(w) < compute_t(0.5);  // torch's lerp: the formula exact at its nearer end
  const compute_t coeff = small ? w : w - compute_t(1);
  for (int64_t i = 0; i < n; ++i) {
    const auto gi = static_cast<compute_t>(g[i]), mi = static_cast<compute_t>(m[i]);
    const compute_t diff = gi - mi;
    g[i] = static_cast<scalar_t>(std::fma(-s, mi, gi));
    m[i] = static_cast<scalar_t>(std::fma(coeff, diff, small ? mi : gi));
  }
}

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
inline void run(scalar_t* g, scalar_t* m, int64_t n, compute_t s, compute_t w) {
  loop(g, m, n, s, w);
}

template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
GEARSAM_FMA_CLONE inline void run_fma(scalar_t* g, scalar_t* m, int64_t n, compute_t s, compute_t w) {
  loop(g, m, n, s, w);
}

// The ascent on n elements: (g, m) <- (fma(-s, m, g), lerp(m, g, w)), or m <- g when first; fma: the CPU has the
// instruction (cpu_has_fma), which the loop then compiles to.
template <typename scalar_t, typename compute_t = at::opmath_type<scalar_t>>
inline void span(scalar_t* g, scalar_t* m, int64_t n, compute_t s, compute_t w, bool first, bool fma) {
  if (first)
    std::copy(g, g + n, m);
  else if (fma)
    run_fma(g, m, n, s, w);
  else
    run(g, m, n, s, w);
}

}  // namespace friendly
}  // namespace gearsam::cpu
