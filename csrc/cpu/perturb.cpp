// Perturbation to w + eps and its exact undoing on the CPU.
//
//   perturb:  backup_i = w_i;   w_i <- w_i + scale[block_of_tile[tile(i)]] * T_i^2 * g_i   (w_i kept where scale is 0)
//             T_i = |w_i| + eta (ASAM) or 1; float32 arithmetic (float64 for float64), one rounding to the stored
//             dtype (round to nearest even), multiply and add rounded separately (built with -ffp-contract=off)
//   restore:  w_i <- backup_i   (memcpy)
//
// Each tile is first copied to the backup whole, then updated while it is still in cache: cheaper than writing the
// backup element by element in the update loop. The backup and the restored parameter are written without being read,
// with non-temporal stores where the buffer is larger than the cache (stream.h).

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "../gearsam.h"
#include "tiles.h"

namespace gearsam::cpu {
namespace {

template <bool Adaptive, typename scalar_t>
void perturb_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
                   const at::Tensor& block_of_tile, int64_t tile, double eta) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* w = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  scalar_t* saved = backup.mutable_data_ptr<scalar_t>();
  const double* block_scale = scale.const_data_ptr<double>();
  const int32_t* block_of = block_of_tile.const_data_ptr<int32_t>();
  const compute_t eta_c = static_cast<compute_t>(eta);
  const bool stream = stream_stores(backup.nbytes());
  for_each_tile(block_of_tile.numel(), tile, [&](int64_t t) {
    const compute_t s = static_cast<compute_t>(block_scale[block_of[t]]);
    if (stream)
      stream_copy(saved + t * tile, w + t * tile, tile * sizeof(scalar_t));
    else
      std::memcpy(saved + t * tile, w + t * tile, tile * sizeof(scalar_t));
    if (s == 0) return;  // a block skipped this step keeps its bits, even where its gradient is inf or NaN
    for (int64_t i = t * tile; i < (t + 1) * tile; ++i) {
      const compute_t x = static_cast<compute_t>(w[i]);
      compute_t direction = static_cast<compute_t>(g[i]);
      if constexpr (Adaptive) {
        const compute_t T = std::abs(x) + eta_c;
        direction = T * T * direction;
      }
      w[i] = static_cast<scalar_t>(x + direction * s);
    }
  });
}

}  // namespace

void perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
             const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "gearsam_perturb_cpu", [&] {
    if (adaptive)
      perturb_tiles<true, scalar_t>(param, grad, backup, scale, block_of_tile, tile, eta);
    else
      perturb_tiles<false, scalar_t>(param, grad, backup, scale, block_of_tile, tile, eta);
  });
}

void restore(const at::Tensor& param, const at::Tensor& backup) {
  char* dst = static_cast<char*>(param.mutable_data_ptr());
  const char* src = static_cast<const char*>(backup.const_data_ptr());
  const int64_t bytes = param.numel() * param.element_size();
  const bool stream = stream_stores(bytes);
  at::parallel_for(0, bytes, kGrainElements * 4, [&](int64_t begin, int64_t end) {
    if (stream) {
      stream_copy(dst + begin, src + begin, end - begin);
      store_fence();
    } else {
      std::memcpy(dst + begin, src + begin, end - begin);
    }
  });
}

}  // namespace gearsam::cpu
