// AVX2 vectors of float and double behind one interface, for the loops that store their results straight to memory
// (non-temporal stores, stream.h): GCC writes no such store from a plain loop, so those loops are written in
// intrinsics, once for both types. Every operation is the IEEE one of its scalar counterpart (fma rounds once, like
// std::fma; neg and abs set the sign bit, like unary minus and std::abs; nan_max is torch.maximum's rule), so a
// vector loop gives the bits of the scalar loop it mirrors.
//
// Only where GCC targets x86-64 (GEARSAM_VEC is then defined); the functions compile for AVX2 + FMA, so they may only
// be called from code compiled for it (GEARSAM_FMA_CLONE) on a CPU that has both (cpu_has_fma).
#pragma once

#include <cstdint>

// x86-64 CPUs without FMA exist, so the build cannot assume it, and std::fma is then a call into libm per element:
// correct, but it stops vectorisation and leaves the loop bound by the calls rather than by memory. So the kernels'
// loops are compiled twice, once for AVX2 + FMA (GEARSAM_FMA_CLONE), where the fma is one instruction and the loop
// vectorises, and the CPU picks at run time. Both give the same bits: an fma rounds once either way.
#if defined(__GNUC__) && defined(__x86_64__)
#define GEARSAM_FMA_CLONE __attribute__((target("avx2,fma")))
namespace gearsam::cpu {
inline bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
}  // namespace gearsam::cpu
#else
#define GEARSAM_FMA_CLONE
namespace gearsam::cpu {
inline bool cpu_has_fma() { return false; }
}  // namespace gearsam::cpu
#endif

// A loop body shared by a function and its GEARSAM_FMA_CLONE twin is inlined into each, so that each compiles it for
// its own target.
#if defined(__GNUC__)
#define GEARSAM_INLINE inline __attribute__((always_inline))
#else
#define GEARSAM_INLINE inline
#endif

// A function for a rare case (tile_sum_wide), kept out of line so that it adds nothing to the loops that call it.
#if defined(__GNUC__)
#define GEARSAM_COLD __attribute__((noinline, cold))
#else
#define GEARSAM_COLD
#endif

#if defined(__GNUC__) && defined(__x86_64__)
#define GEARSAM_VEC 1

#include <immintrin.h>

#define GEARSAM_VEC_OP static inline __attribute__((always_inline, target("avx2,fma")))

namespace gearsam::cpu {

template <typename T>
struct Vec;

template <>
struct Vec<float> {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  GEARSAM_VEC_OP V set1(float x) { return _mm256_set1_ps(x); }
  GEARSAM_VEC_OP V load(const float* p) { return _mm256_loadu_ps(p); }
  GEARSAM_VEC_OP void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  GEARSAM_VEC_OP void stream(float* p, V x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  GEARSAM_VEC_OP V add(V a, V b) { return _mm256_add_ps(a, b); }
  GEARSAM_VEC_OP V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  GEARSAM_VEC_OP V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  GEARSAM_VEC_OP V div(V a, V b) { return _mm256_div_ps(a, b); }
  GEARSAM_VEC_OP V sqrt(V a) { return _mm256_sqrt_ps(a); }
  GEARSAM_VEC_OP V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  GEARSAM_VEC_OP V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  GEARSAM_VEC_OP V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  // (a < b || isnan(b)) ? b : a, as nan_max in base_step.cpp: max(b, a) is b > a ? b : a, a where either is NaN
  GEARSAM_VEC_OP V nan_max(V a, V b) {
    return _mm256_blendv_ps(_mm256_max_ps(b, a), b, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  }
};

template <>
struct Vec<double> {
  using V = __m256d;
  static constexpr int64_t kWidth = 4;
  GEARSAM_VEC_OP V set1(double x) { return _mm256_set1_pd(x); }
  GEARSAM_VEC_OP V load(const double* p) { return _mm256_loadu_pd(p); }
  GEARSAM_VEC_OP void store(double* p, V x) { _mm256_storeu_pd(p, x); }
  GEARSAM_VEC_OP void stream(double* p, V x) { _mm256_stream_pd(p, x); }  // p 32-byte aligned
  GEARSAM_VEC_OP V add(V a, V b) { return _mm256_add_pd(a, b); }
  GEARSAM_VEC_OP V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  GEARSAM_VEC_OP V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  GEARSAM_VEC_OP V div(V a, V b) { return _mm256_div_pd(a, b); }
  GEARSAM_VEC_OP V sqrt(V a) { return _mm256_sqrt_pd(a); }
  GEARSAM_VEC_OP V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  GEARSAM_VEC_OP V neg(V a) { return _mm256_xor_pd(a, _mm256_set1_pd(-0.0)); }
  GEARSAM_VEC_OP V abs(V a) { return _mm256_andnot_pd(_mm256_set1_pd(-0.0), a); }
  GEARSAM_VEC_OP V nan_max(V a, V b) {
    return _mm256_blendv_pd(_mm256_max_pd(b, a), b, _mm256_cmp_pd(b, b, _CMP_UNORD_Q));
  }
};

// Whether n elements at out can go through a vector loop that streams: a CPU with AVX2 and FMA, whole vectors, out
// aligned for stream().
template <typename T>
bool vec_streams(const T* out, int64_t n) {
  return cpu_has_fma() && n % Vec<T>::kWidth == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0;
}

}  // namespace gearsam::cpu

#undef GEARSAM_VEC_OP
#endif
