// Perturbation to w + eps and its exact undoing on the CPU.
//
//   perturb:  backup_i = w_i;   w_i <- w_i + scale[block_of_tile[tile(i)]] * T_i^2 * g_i   (w_i kept where scale is 0)
//             T_i = |w_i| + eta (ASAM) or 1; float32 arithmetic (float64 for float64), one rounding to the stored
//             dtype (round to nearest even), multiply and add rounded separately (built with -ffp-contract=off);
//             with kept, kept_i = g_i as well (a copy of the stored bits, in every block)
//   restore:  w_i <- backup_i   (memcpy)
//
// Each tile is first copied to the backup whole, then updated while it is still in cache: cheaper than writing the
// backup element by element in the update loop. The backup and the restored parameter are written without being read,
// with non-temporal stores where the buffer is larger than the cache (stream.h); there, float32 and float64 tiles go
// through one vector loop (vec.h) that streams each vector of w to the backup as it loads it and updates it in place,
// so that the stores leave while the loads go on. Where param and backup may exchange their memory (exchange.h), the
// pass instead writes w + eps into the backup, leaving w as it is, and then exchanges the two: the same values in the
// same tensors, one stream of writes fewer.

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "../gearsam.h"
#include "exchange.h"
#include "tiles.h"
#include "vec.h"

namespace gearsam::cpu {
namespace {

#if defined(GEARSAM_VEC)
// One tile of perturb_tiles (a float32 or float64 buffer) in vectors, operation for operation: the same bits. Into:
// w + eps streamed to saved, w left as it is.
template <bool Adaptive, bool Keep, bool Into, typename scalar_t>
GEARSAM_FMA_CLONE void perturb_stream(scalar_t* w, const scalar_t* g, scalar_t* saved, scalar_t* kept, int64_t n,
                                      scalar_t s, scalar_t eta) {
  using V = Vec<scalar_t>;
  const auto scale = V::set1(s), eta_v = V::set1(eta);
  for (int64_t i = 0; i < n; i += V::kWidth) {
    const auto x = V::load(w + i);
    if constexpr (!Into) V::stream(saved + i, x);
    auto direction = V::load(g + i);
    if constexpr (Keep) V::stream(kept + i, direction);
    if constexpr (Adaptive) {
      const auto T = V::add(V::abs(x), eta_v);
      direction = V::mul(V::mul(T, T), direction);
    }
    const auto perturbed = V::add(x, V::mul(direction, scale));
    if constexpr (Into)
      V::stream(saved + i, perturbed);
    else
      V::store(w + i, perturbed);
  }
}
#endif

// Writes `bytes` of a tile that the pass does not read again: streamed past the cache where `stream`, else memcpy.
inline void copy_tile(void* dst, const void* src, int64_t bytes, bool stream) {
  if (stream)
    stream_copy(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

// Whether float32 and float64 tiles past the caches take the vector loop: only there is writing into the backup
// cheaper (the scalar loop copies w to it first).
template <typename scalar_t>
bool vectorised() {
#if defined(GEARSAM_VEC)
  return std::is_same_v<scalar_t, at::opmath_type<scalar_t>> && cpu_has_fma();
#else
  return false;
#endif
}

// Into: w + eps written to backup, param only read (exchange.h), by the same loops.
template <bool Adaptive, bool Keep, bool Into, typename scalar_t>
void perturb_tiles(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
                   const at::Tensor& block_of_tile, int64_t tile, double eta, const at::Tensor& kept) {
  using compute_t = at::opmath_type<scalar_t>;
  scalar_t* w = param.mutable_data_ptr<scalar_t>();
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  scalar_t* saved = backup.mutable_data_ptr<scalar_t>();
  scalar_t* keep = Keep ? kept.mutable_data_ptr<scalar_t>() : nullptr;
  scalar_t* out = Into ? saved : w;
  const double* block_scale = scale.const_data_ptr<double>();
  const int32_t* block_of = block_of_tile.const_data_ptr<int32_t>();
  const compute_t eta_c = static_cast<compute_t>(eta);
  const bool stream = stream_stores(backup.nbytes());
  for_each_tile(block_of_tile.numel(), tile, [&](int64_t t) {
    const compute_t s = static_cast<compute_t>(block_scale[block_of[t]]);
#if defined(GEARSAM_VEC)
    if constexpr (std::is_same_v<scalar_t, compute_t>) {  // float32, float64
      if (stream && s != 0 && vec_streams(saved + t * tile, tile) && (!Keep || vec_streams(keep + t * tile, tile)))
        return perturb_stream<Adaptive, Keep, Into>(w + t * tile, g + t * tile, saved + t * tile,
                                                    Keep ? keep + t * tile : nullptr, tile, s, eta_c);
    }
#endif
    copy_tile(saved + t * tile, w + t * tile, tile * sizeof(scalar_t), stream);
    if constexpr (Keep) copy_tile(keep + t * tile, g + t * tile, tile * sizeof(scalar_t), stream);
    if (s == 0) return;  // a block skipped this step keeps its bits, even where its gradient is inf or NaN
    for (int64_t i = t * tile; i < (t + 1) * tile; ++i) {
      const compute_t x = static_cast<compute_t>(w[i]);
      compute_t direction = static_cast<compute_t>(g[i]);
      if constexpr (Adaptive) {
        const compute_t T = std::abs(x) + eta_c;
        direction = T * T * direction;
      }
      out[i] = static_cast<scalar_t>(x + direction * s);
    }
  });
  if constexpr (Into) exchange_memory(param, backup);
}

}  // namespace

void perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
             const at::Tensor& block_of_tile, int64_t tile, bool adaptive, double eta, const at::Tensor& kept) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "gearsam_perturb_cpu", [&] {
    with_flag(adaptive, [&](auto a) {
      with_flag(kept.defined(), [&](auto k) {
        with_flag(vectorised<scalar_t>() && exchangeable(param, backup), [&](auto into) {
          perturb_tiles<decltype(a)::value, decltype(k)::value, decltype(into)::value, scalar_t>(
              param, grad, backup, scale, block_of_tile, tile, eta, kept);
        });
      });
    });
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
