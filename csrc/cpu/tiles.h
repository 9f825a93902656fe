// Splitting a bucket's tiles between CPU threads, and turning run-time flags into template parameters.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "stream.h"

namespace gearsam::cpu {

// Elements a thread should get at least, so that small buckets are not split into tasks that cost more to schedule
// than to run (the value ATen uses for its own elementwise kernels).
constexpr int64_t kGrainElements = 32768;

// Calls fn(begin, end) for ranges of whole tiles [begin, end) covering [0, n_tiles), one range per task, split between
// threads. Every task ends with a store fence, so what it wrote with non-temporal stores is in place when this returns.
template <typename Fn>
void for_each_tile_range(int64_t n_tiles, int64_t tile, const Fn& fn) {
  at::parallel_for(0, n_tiles, std::max<int64_t>(1, kGrainElements / tile), [&](int64_t begin, int64_t end) {
    fn(begin, end);
    store_fence();
  });
}

// Calls fn(t) for every tile t in [0, n_tiles), split between threads in whole tiles. Every tile's work is independent
// of the split, so results do not depend on the number of threads.
template <typename Fn>
void for_each_tile(int64_t n_tiles, int64_t tile, const Fn& fn) {
  for_each_tile_range(n_tiles, tile, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

// Calls fn with std::true_type or std::false_type: a run-time flag turned into a template parameter.
template <typename Fn>
void with_flag(bool flag, const Fn& fn) {
  if (flag)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

}  // namespace gearsam::cpu
