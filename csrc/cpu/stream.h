// Stores that bypass the caches, for outputs a pass writes without reading them.
//
// A plain store to a line that is not in the cache first reads that line from memory (write-allocate), so a pass that
// writes a buffer without reading it moves the buffer's bytes twice: the perturbation's backup, the restore's and the
// base step's parameter. Non-temporal stores write whole lines straight to memory. They pay off where the buffer would
// be out of the cache by its next read anyway: where it is larger than a core's private (level-2) cache. A SAM step
// goes through at least three such buffers (param, grad, backup) between two reads of one of them, and the model's
// forward and backward come between its passes. The shared last-level cache is not counted on: every core of the
// socket, and on a server every other process, fills it too, so a buffer that fits it on paper may be gone by its
// next read anyway, and a threshold at its size would leave such buffers to plain stores, which move every byte twice
// (docs/performance.md, "The stream threshold").
#pragma once

#include <cstdint>

namespace gearsam::cpu {

// Outputs larger than this many bytes are written with non-temporal stores: a core's private cache's size (1 MiB
// where the system does not say), or -1 where the CPU has no such stores. The stream threshold.
int64_t stream_threshold_bytes();

// Whether a pass writing an output of this many bytes uses non-temporal stores.
bool stream_stores(int64_t bytes);

// dst = src, bytes of them, with non-temporal stores where the CPU has them (x86-64; elsewhere memcpy). Not ordered
// with later stores until store_fence().
void stream_copy(void* dst, const void* src, int64_t bytes);

// Orders the non-temporal stores made so far before any later store: every parallel task that streams ends with it,
// so the buffers are complete when the parallel region returns.
void store_fence();

}  // namespace gearsam::cpu
