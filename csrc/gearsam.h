// The fused SAM step as four operations over one flat bucket (see gearsam_fused/flat.py for the layout):
//
//   block_energy  e_b = sum_{i in block b} (T_i g_i)^2          per-tile partials, then a fixed-order sum per block
//   allocate      EMA update, radii and per-block scales        GEAR or SAM rule, float64, on the buffers' device
//   perturb_      backup = w;  w <- w + scale[block] * T^2 g    T = |w| + eta (ASAM) or 1
//   restore_      w <- backup                                   a copy of the stored bits
//
// ops.cpp checks the arguments and calls the implementation for the tensors' device: namespace cpu (cpu/*.cpp) or
// namespace cuda (cuda/*.cu, declared and compiled only when WITH_CUDA is defined). Every implementation receives tensors that
// ops.cpp has already checked, and allocates nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace gearsam {

at::Tensor block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& block_tiles,
                        const at::Tensor& partials, int64_t tile, bool adaptive, double eta);
std::tuple<at::Tensor, at::Tensor> allocate(const at::Tensor& energy, const at::Tensor& ema, bool gear, double rho,
                                            double beta, double delta);
void perturb_(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,
              const at::Tensor& tile_block, int64_t tile, bool adaptive, double eta);
void restore_(const at::Tensor& param, const at::Tensor& backup, int64_t tile);

#define GEARSAM_DEVICE_IMPLEMENTATIONS                                                                              \
  void block_energy(const at::Tensor& grad, const at::Tensor& param, const at::Tensor& block_tiles,                 \
                    const at::Tensor& partials, const at::Tensor& energy, int64_t tile, bool adaptive, double eta); \
  void allocate(const at::Tensor& energy, const at::Tensor& ema, const at::Tensor& scale, const at::Tensor& radius, \
                bool gear, double rho, double beta, double delta);                                                   \
  void perturb(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& backup, const at::Tensor& scale,  \
               const at::Tensor& tile_block, int64_t tile, bool adaptive, double eta);                              \
  void restore(const at::Tensor& param, const at::Tensor& backup);

namespace cpu {
GEARSAM_DEVICE_IMPLEMENTATIONS
}  // namespace cpu

#ifdef WITH_CUDA
namespace cuda {
GEARSAM_DEVICE_IMPLEMENTATIONS
}  // namespace cuda
#endif

#undef GEARSAM_DEVICE_IMPLEMENTATIONS

// Whether this build contains the CUDA implementations.
bool built_with_cuda();

}  // namespace gearsam
