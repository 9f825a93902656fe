// What the CUDA kernels share: 16-byte vector access, a deterministic block reduction, unfused arithmetic, and the
// launch context (device guard, current stream, grid size).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gearsam::cuda {

constexpr int kThreads = 256;  // per block, a multiple of the warp size (block_sum relies on it)
constexpr int kWarp = 32;

// kVec elements of scalar_t in one 16-byte load or store.
template <typename scalar_t>
constexpr int kVec = 16 / sizeof(scalar_t);

template <typename scalar_t, int N>
struct alignas(sizeof(scalar_t) * N) Pack {
  scalar_t v[N];
};

// Vector access needs every pointer 16-byte aligned and every tile a whole number of vectors.
template <int Vec>
bool vectorizable(int64_t tile, std::initializer_list<const void*> pointers) {
  if (tile % Vec) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

// Multiply and add rounded separately: never contracted into an FMA, so `w + scale * g` rounds like the reference.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
// The rest of the explicitly rounded arithmetic the fused base steps need: each is one IEEE operation, rounded to
// nearest even, that nvcc may neither fuse with a neighbour nor replace by an approximation. fma_rn is the one place
// a multiply and an add share a rounding, where ATen's CPU kernels do the same.
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

// F-SAM's ascent on one element (formula and roundings in cpu/mix.cpp), shared by its kernel (mix.cu) and the one
// that sums the new gradient's energies in the same read (energy.cu). The lerp's anchor and coefficient are decided
// once, on the weight in the compute type (torch's rule).
template <typename compute_t>
struct Friendly {
  compute_t s, coeff;
  bool small;

  __device__ Friendly(double sigma, double lmbda) : s(static_cast<compute_t>(sigma)) {
    const auto w = static_cast<compute_t>(1.0 - lmbda);
    small = w < compute_t(0.5) && w > compute_t(-0.5);
    coeff = small ? w : sub_rn(w, compute_t(1));
  }

  // (g, m) <- (fma(-s, m, g), lerp(m, g, w)), each rounded to scalar_t
  template <typename scalar_t>
  __device__ __forceinline__ void operator()(scalar_t& g, scalar_t& m) const {
    const auto gk = static_cast<compute_t>(g), mk = static_cast<compute_t>(m);
    g = static_cast<scalar_t>(fma_rn(-s, mk, gk));
    m = static_cast<scalar_t>(fma_rn(coeff, sub_rn(gk, mk), small ? mk : gk));
  }
};

// `value` combined over the thread block by `op` (an associative binary functor), valid in thread 0, or in every
// thread where `everyone` is given (thread 0 writes it there before the last barrier; the next call writes it again
// only after its first barrier, which every thread reaches after reading it). The shuffle tree and the warp order are
// fixed, so the same inputs always give the same bits. `scratch` holds kThreads / kWarp entries; the block must be
// kThreads wide; `identity` is op's neutral element.
template <typename Op>
__device__ __forceinline__ double block_reduce(double value, double* scratch, double identity, Op op,
                                               double* everyone = nullptr) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / kWarp ? scratch[lane] : identity;
    for (int offset = kWarp / 2; offset > 0; offset /= 2) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
    if (everyone && lane == 0) *everyone = value;
  }
  __syncthreads();  // scratch may be reused right after
  return everyone ? *everyone : value;
}

__device__ __forceinline__ double block_sum(double value, double* scratch, double* everyone = nullptr) {
  return block_reduce(value, scratch, 0.0, [](double a, double b) { return a + b; }, everyone);
}

// Data pointer of an optional tensor, null where it is undefined (not given).
template <typename T>
const T* optional_data(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// Enough blocks to fill the device a few times over, no more than there is work for: kernels loop over the rest.
inline int grid_for(int64_t work_items, int device) {
  static int sm_count[64] = {};
  if (device < 64 && sm_count[device] == 0)
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count[device], cudaDevAttrMultiProcessorCount, device));
  const int64_t cap = int64_t(device < 64 ? sm_count[device] : 132) * 8;
  return static_cast<int>(work_items < cap ? (work_items > 0 ? work_items : 1) : cap);
}

}  // namespace gearsam::cuda
